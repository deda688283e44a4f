"""A Ctrl-C that arrives once `mmtrain convert` has written its whole output (while --dst is put in
place, the replaced folder removed, the lock released) no longer turns success into exit 130
(issue 45): the command exits 0 and says the output is complete. One before that stops it (130)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.llava_tiny import hf_llava


def test_interrupt_after_the_output_is_complete_exits_0_saying_so(tmp_path, monkeypatch, capsys):
    from mmdata import folder_lock
    from mmtrain.cli import main

    src = tmp_path / "hf"
    hf_llava(seed=1).save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    publish = folder_lock._publish

    def publish_then_ctrl_c(tmp, dst):  # Ctrl-C right after --dst is in place, before the command ends
        publish(tmp, dst)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(folder_lock, "_publish", publish_then_ctrl_c)
    dst = tmp_path / "ckpt"
    assert main(["convert", "hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(dst)]) == 0
    err = capsys.readouterr().err
    assert f"mmtrain convert hf-to-mcore: interrupt received after --dst {dst} was complete; nothing was lost" in err, (
        err
    )
    assert (dst / "latest").is_file() and not list(tmp_path.glob(".ckpt.*"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


@pytest.mark.unit
def test_an_interrupt_before_completion_still_stops():
    from mmdata.errors import InterruptsAfterCompletion

    with pytest.raises(KeyboardInterrupt), InterruptsAfterCompletion("prog", "x"):
        os.kill(os.getpid(), signal.SIGINT)  # (Python's handler raises at the next bytecode)
    with InterruptsAfterCompletion("prog", "x") as guard:
        guard.hold()
        os.kill(os.getpid(), signal.SIGINT)
    assert guard.received == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
