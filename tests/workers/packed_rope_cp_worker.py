"""torchrun worker (2 ranks, gloo, CP=2) for tests/test_packed_rope.py: the tiny decoder's
per-token losses on each CP rank's share of a packed row, with the layer spec's
`PackedRoPESelfAttention` and with megatron's own `SelfAttention` (unfused THD RoPE, CP slicing
by `_get_thd_freqs_on_this_cp_rank`), the same weights; forward and backward. Writes whether they
are equal, and the host reads each path made."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class HostReads(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "__bool__", "__int__"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def run(megatrons: bool, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    from mmtrain.models.context_parallel import current_layout
    from mmtrain.models.language_model import packed_decoder_forward
    from tests.tiny_decoder import packed_batch, tiny_lm

    lm = tiny_lm(megatrons)
    batch = packed_batch(lens)
    layout = current_layout(batch.host_cu_seqlens())
    with HostReads() as reads:
        loss = packed_decoder_forward(lm, batch, layout)  # [1, S], zero where the other rank holds
    loss.sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in lm.parameters() if p.grad is not None])
    return loss.detach(), grads, reads.n


def main() -> None:
    torch.set_num_threads(1)
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1, cp=2)
    res: dict = {}
    for lens in ([12, 8, 20], [7, 30, 1, 9]):  # the last: a padding run; uneven lengths pad to 2*cp
        ours, ours_g, ours_n = run(False, lens)
        ref, ref_g, ref_n = run(True, lens)
        key = "-".join(map(str, lens))
        res[key] = {
            "loss_equal": bool(torch.equal(ours, ref)),
            "grads_equal": bool(torch.equal(ours_g, ref_g)),
            "reads_ours": ours_n,
            "reads_megatron": ref_n,
            "nonzero": int((ours != 0).sum()),
        }
    rank = torch.distributed.get_rank()
    Path(f"{sys.argv[1]}.{rank}").write_text(json.dumps(res))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
