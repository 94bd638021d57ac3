"""cuBLASLt's algorithms for the decode GEMMs, timed one by one against torch's choice.

    PYTHONPATH=. python -m benchmarks.cublaslt_algos [--batches 1 16 64 256] [--sweep]

torch runs one cuBLAS algorithm per shape (the heuristic's first). This asks cuBLASLt (through
ctypes) for every algorithm its heuristic offers, and with --sweep also varies each one's split-K
count and reduction scheme; each candidate's output is checked against F.linear and timed in a
CUDA graph of 28 calls on 28 distinct weights (us per call, median). Prints, per GEMM and batch,
torch's time, the heuristic's first, the best found and its configuration."""

import argparse
import ctypes

import torch
import torch.nn.functional as F

from benchmarks.gemm_layouts import LAYERS, layer_shapes, random_bf16
from benchmarks.runs import graph_replay_us
from benchmarks.shapes import SHAPES

_COMPUTE_32F, _R_16BF, _R_32F = 68, 14, 0
_DESC_TRANSA, _DESC_TRANSB, _PREF_MAX_WORKSPACE = 3, 4, 1
_CFG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "stages": 6,
        "cluster": 8}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cuBLAS status {status}")


class CublasLt:
    """A cuBLASLt handle, a workspace, and y = x @ W^T plans for bf16 weights of either layout."""

    def __init__(self, workspace_bytes: int = 32 << 20) -> None:
        torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))  # loads it
        self.lib = ctypes.CDLL(f"libcublasLt.so.{torch.version.cuda.split('.')[0]}")
        self.lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 13 + [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), _R_16BF, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
            ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
        return layout

    def plan(self, m: int, weight: torch.Tensor) -> tuple:
        """Descriptors for x[m, K] @ weight.T with weight [N, K] row-major or a k-major view."""
        n, k = weight.shape
        desc = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F),
               "cublasLtMatmulDescCreate")
        k_major = weight.stride(0) == 1  # [K, N] storage seen through a transposed view
        trans_a = ctypes.c_int32(0 if k_major else 1)
        _check(self.lib.cublasLtMatmulDescSetAttribute(desc, _DESC_TRANSA, ctypes.byref(trans_a),
                                                       ctypes.c_size_t(4)), "TRANSA")
        # column-major view of row-major storage: W [N, K] is K x N (ld K), transposed by op A
        a = self._layout(n, k, n) if k_major else self._layout(k, n, k)
        return desc, a, self._layout(k, m, k), self._layout(n, m, n)

    def heuristics(self, plan: tuple, count: int = 64) -> list[Heuristic]:
        desc, a, b, d = plan
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(self.workspace.numel())
        _check(self.lib.cublasLtMatmulPreferenceSetAttribute(
            pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), ctypes.c_size_t(8)), "workspace")
        results, returned = (Heuristic * count)(), ctypes.c_int(0)
        _check(self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, d, d, pref, count, results, ctypes.byref(returned)),
            "cublasLtMatmulAlgoGetHeuristic")
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def variants(self, plan: tuple, base: Algo) -> list[Algo]:
        """base with every split-K count and reduction scheme cuBLASLt accepts for the plan."""
        out = []
        for splitk in (1, 2, 3, 4, 6, 8, 12, 16):
            for scheme in (0, 1, 2, 4):
                algo = Algo.from_buffer_copy(base)
                if not (self._set(algo, "splitk", splitk) and self._set(algo, "reduction", scheme)):
                    continue
                result = Heuristic()
                desc, a, b, d = plan
                if self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, d, d,
                                                    ctypes.byref(algo), ctypes.byref(result)) == 0 \
                        and result.workspace <= self.workspace.numel():
                    out.append(algo)
        return out

    def _set(self, algo: Algo, name: str, value: int) -> bool:
        v = ctypes.c_uint32(value)
        return self.lib.cublasLtMatmulAlgoConfigSetAttribute(
            ctypes.byref(algo), _CFG[name], ctypes.byref(v), ctypes.c_size_t(4)) == 0

    def config(self, algo: Algo) -> str:
        parts = []
        for name, attr in _CFG.items():
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                          ctypes.c_size_t(4), ctypes.byref(written))
            parts.append(f"{name}={v.value}")
        return " ".join(parts)

    def matmul(self, plan: tuple, algo: Algo, x: torch.Tensor, weight: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
        desc, a, b, d = plan
        stream = torch.cuda.current_stream().cuda_stream
        _check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), weight.data_ptr(), a, x.data_ptr(), b,
            ctypes.byref(self.beta), out.data_ptr(), d, out.data_ptr(), d, ctypes.byref(algo),
            self.workspace.data_ptr(), self.workspace.numel(), stream), "cublasLtMatmul")
        return out


def best_algo(lt: CublasLt, m: int, weights: list, sweep: bool, reps: int) -> tuple:
    """(torch us, heuristic-first us, best us, best config, candidates) for x[m, K] @ W^T."""
    n, k = weights[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0])
    torch_us = graph_replay_us(lambda: [F.linear(x, w) for w in weights], reps, 1) / len(weights)
    plan = lt.plan(m, weights[0])
    found = lt.heuristics(plan)
    algos = [h.algo for h in found]
    if sweep:
        algos += [v for h in found[:4] for v in lt.variants(plan, h.algo)]
    timed = []
    for algo in algos:
        try:
            lt.matmul(plan, algo, x, weights[0], out)
            torch.cuda.synchronize()
        except RuntimeError:
            continue
        if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
            continue
        fn = lambda algo=algo: [lt.matmul(plan, algo, x, w, out) for w in weights]  # noqa: E731
        timed.append((graph_replay_us(fn, reps, 1) / len(weights), algo))
    first = timed[0][0] if timed else float("nan")
    best_us, best = min(timed, key=lambda t: t[0])
    return torch_us, first, best_us, lt.config(best), len(timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--sweep", action="store_true", help="also vary split-K and reduction")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    lt = CublasLt()
    weights = {}
    for name, (n, k) in layer_shapes(SHAPES[args.shape]).items():
        k_major = name in ("o", "down")  # as RowParallelLinear stores them
        weights[name] = [random_bf16(k, n).t() if k_major else random_bf16(n, k)
                         for _ in range(LAYERS)]
    print(f"{torch.cuda.get_device_name()}, {args.shape}, us per GEMM call: torch / "
          "cuBLASLt heuristic's first / best found (candidates) config")
    for m in args.batches:
        totals = [0.0, 0.0]
        for name, ws in weights.items():
            t, first, best, cfg, count = best_algo(lt, m, ws, args.sweep, args.reps)
            totals[0] += t
            totals[1] += min(best, t)
            print(f"M={m:3d} {name:7s} {t:6.2f} / {first:6.2f} / {best:6.2f} ({count:3d}) {cfg}",
                  flush=True)
        print(f"M={m:3d} layer   {totals[0]:6.2f} -> {totals[1]:6.2f} us "
              f"({100 * (totals[1] / totals[0] - 1):+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
