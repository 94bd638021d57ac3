"""What-if ceilings for the standard run: the same run with some classes of kernels made free
(not launched at all), so the time each class costs, kernels and launch gaps both, shows.

    python -m benchmarks.ceilings [--skip norm,silu,qk,gemm] [step_floor's flags]

norm: RMSNorm and add + RMSNorm return their inputs; silu: SiLU-and-mul returns a view of its
input's first half; qk: q/k norm + RoPE + K/V write returns q and k untouched (nothing written);
gemm: the decoder layers' linear layers return an uninitialised tensor (the LM head still
runs). The results are garbage, but every step's work is otherwise unchanged: bench requests
ignore EOS and stop at max_tokens, and no kernel left reads or writes an amount that depends on
values. Prints step_floor's table for the run.
"""
import argparse

import torch

from benchmarks import step_floor
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.backends import TorchBackend
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase, RowParallelLinear


def _empty_linear(self, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], self.weight.shape[0])


SKIPS = {
    "norm": lambda: setattr(RMSNorm, "forward", lambda self, x, residual=None:
                            x if residual is None else (x, residual)),
    "silu": lambda: setattr(SiluAndMul, "forward",
                            lambda self, x: x.narrow(-1, 0, x.shape[-1] // 2)),
    "qk": lambda: setattr(TorchBackend, "rope_and_store",
                          lambda self, attn, positions, q, k, v: (q, k)),
    "gemm": lambda: [setattr(cls, "forward", _empty_linear)
                     for cls in (LinearBase, RowParallelLinear)],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip", default="", help=f"comma list of {sorted(SKIPS)}")
    args, rest = p.parse_known_args()
    skips = [s for s in args.skip.split(",") if s]
    for name in skips:
        if name not in SKIPS:
            raise SystemExit(f"--skip: {name!r} is not one of {sorted(SKIPS)}")
        SKIPS[name]()
    print(f"== skipped: {', '.join(skips) or 'nothing (shipped)'}")
    step_floor.main(rest)


if __name__ == "__main__":
    main()
