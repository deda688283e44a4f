"""One process: train two steps of a recipe and compare the peak memory it took with the
dry-run estimate of that recipe (tests/test_train_runtime.py::test_dry_run_memory_matches_a_measured_peak).

argv: RECIPE OUT_JSON OVERRIDES_JSON
Measured = peak RSS over the two steps (ru_maxrss) - RSS before the model was built (the
interpreter, torch, megatron and the loader's process-side state, which the estimate does not
model). Written: {"measured": bytes, "estimate": {component: bytes}}.
"""

import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import psutil
    import torch

    torch.set_num_threads(1)
    from mmtrain import registry
    from mmtrain.config import dump_recipe, load_recipe
    from mmtrain.planning.dry_run import build_report
    from mmtrain.runtime.distributed import destroy_distributed, init_distributed
    from mmtrain.runtime.trainer import Trainer

    recipe = load_recipe(sys.argv[1], json.loads(sys.argv[3]))
    spec = registry.get_family(recipe.family)
    ctx = init_distributed(recipe.parallel, seed=recipe.seed)
    trainer = Trainer(recipe, spec, ctx, dump_recipe(recipe))
    base = psutil.Process().memory_info().rss
    trainer.setup()
    after_setup = psutil.Process().memory_info().rss
    trainer.train_step()
    trainer.train_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = build_report(recipe, spec).memory
    estimate = {
        k: getattr(m, k) for k in ("weights", "grads", "optimizer", "activations", "logits", "encoder_activations")
    }
    Path(sys.argv[2]).write_text(
        json.dumps({"measured": peak - base, "setup": after_setup - base, "estimate": estimate, "total": m.total})
    )
    trainer.data.close()
    destroy_distributed()


if __name__ == "__main__":
    main()
