"""Re-export of `mmdata.energon_loaders.llava_ov.anyres` at its former path, kept while other
branches still import it from here; new code imports the `llava_ov` module."""

from mmdata.energon_loaders.llava_ov.anyres import *  # noqa: F401,F403
