"""AdamW on the host for fp32 masters with bf16 moments or gradients, in one pass.

torch's fused CPU AdamW takes one dtype for all four arrays, so bf16 moments otherwise cost an
upcast into fp32 blocks, the update and a rounding back: five passes over memory where one would
do (0.64x fused AdamW's rate on fp32 moments on an H200 host, docs/evidence/bf16-moments-probe-
h200.txt). This module compiles a small C loop with the system's C compiler on first use (well
under a second; cached per source and CPU under ``~/.cache/offload-runner``) and runs it on
Python threads that release the GIL, each on its own contiguous share. It does the math in fp32
in the order of torch's vectorized kernel, with the two FMAs its build contracts (no other), and
rounds the moments to nearest even as ``copy_`` does: bit for bit the blocks' result here.
Without a compiler ``load()`` returns None and the caller keeps the blocks.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <math.h>
typedef uint16_t bf16;
static inline float up(bf16 h) {
  union { uint32_t u; float f; } x; x.u = (uint32_t)h << 16; return x.f;
}
static inline bf16 down(float f) {
  union { uint32_t u; float f; } x; x.f = f;
  uint32_t r = (x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16;
  return f != f ? (bf16)0x7FC0 : (bf16)r;
}
#define ADAMW(NAME, G, GET_G, PUT_G, M, GET_M, SET_M)                                          \
void NAME(float *restrict p, G *restrict g, M *restrict m, M *restrict v, long n, float decay, \
          float c1, float b2, float c2, float bc2_sqrt, float eps, float neg_step, float scale) { \
  for (long i = 0; i < n; i++) {                                                               \
    float gi = GET_G(g[i]) / scale; PUT_G                                                      \
    float pi = p[i] * decay;                                                                   \
    float mi = GET_M(m[i]); mi = fmaf(c1, gi - mi, mi);                                        \
    float vi = fmaf(c2 * gi, gi, GET_M(v[i]) * b2);                                            \
    p[i] = pi + neg_step * mi / (sqrtf(vi) / bc2_sqrt + eps);                                  \
    m[i] = SET_M(mi); v[i] = SET_M(vi);                                                        \
  }                                                                                            \
}
#define SAME(x) (x)
#define UNSCALED if (scale != 1.0f) g[i] = gi; /* in place, as torch's fused AdamW does */
ADAMW(adamw_g32_m16, float, SAME, UNSCALED, bf16, up, down)
ADAMW(adamw_g16_m16, bf16, up, , bf16, up, down)
ADAMW(adamw_g16_m32, bf16, up, , float, SAME, SAME)
"""
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
ALIGN = 64  # elements: each thread's share starts on a cache line of every array

_LOCK = threading.Lock()
_LIB: list = []  # [the loaded library or None], once tried
_POOLS = threading.local()  # per calling thread: its pool of workers (they inherit its cores)


def load():
    """The compiled kernels (a ctypes library), or None where no C compiler builds them."""
    with _LOCK:
        if not _LIB:
            _LIB.append(_build())
        return _LIB[0]


def _build():
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        log.warning("host kernel: no C compiler (set CC); bf16 moments take the slower blocks")
        return None
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + _cpu_id()).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "offload-runner"
    target = cache / f"host_kernel-{key}.so"
    if not target.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
                src.write_text(SOURCE)
                cmd = [compiler, *FLAGS, str(src), "-o", str(out)]
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                os.replace(out, target)  # atomic: ranks may build at once
        except (OSError, subprocess.SubprocessError) as e:
            log.warning(
                "host kernel: %s failed (%s); bf16 moments take the slower blocks", compiler, e
            )
            return None
    lib = ctypes.CDLL(str(target))
    for name in ("adamw_g32_m16", "adamw_g16_m16", "adamw_g16_m32"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] + [ctypes.c_float] * 8
        fn.restype = None
    return lib


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by unlike
    nodes keeps one build per kind)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(lines[:2])


def supports(master, grad, m, v) -> bool:
    """The kernels cover this CPU case: contiguous fp32 masters, bf16 moments or gradients."""
    import torch

    tensors = (master, grad, m, v)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    if master.dtype != torch.float32 or m.dtype != v.dtype:
        return False
    return _name(grad.dtype, m.dtype) is not None


def _name(grad_dtype, moment_dtype) -> str | None:
    import torch

    names = {
        (torch.float32, torch.bfloat16): "adamw_g32_m16",
        (torch.bfloat16, torch.bfloat16): "adamw_g16_m16",
        (torch.bfloat16, torch.float32): "adamw_g16_m32",
    }
    return names.get((grad_dtype, moment_dtype))


def adamw(lib, master, grad, m, v, h: dict, step: float, grad_scale: float = 1.0) -> None:
    """AdamW with ``h``'s hyperparameters (lr, beta1, beta2, eps, weight_decay) at ``step`` on
    one CPU case ``supports`` accepts, split over this thread's torch thread count."""
    import torch

    fn = getattr(lib, _name(grad.dtype, m.dtype))
    lr, b1, b2 = h["lr"], h["beta1"], h["beta2"]
    # in double, then rounded to fp32 once each, as torch's kernel computes them
    scalars = (1 - lr * h["weight_decay"], 1 - b1, b2, 1 - b2, (1 - b2**step) ** 0.5, h["eps"])
    scalars += (-lr / (1 - b1**step), grad_scale)
    n = master.numel()
    threads = max(1, min(torch.get_num_threads(), n // (16 * ALIGN)))
    share = -(-n // threads // ALIGN) * ALIGN

    def run(a: int) -> None:
        b = min(a + share, n)
        ptrs = (t.data_ptr() + a * t.element_size() for t in (master, grad, m, v))
        fn(*ptrs, b - a, *scalars)

    if threads == 1:
        run(0)
        return
    list(_pool(threads).map(run, range(0, n, share)))


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """This thread's pool of ``threads`` workers (a new one when its team size changed)."""
    pool, size = getattr(_POOLS, "pool", None), getattr(_POOLS, "size", 0)
    if pool is None or size != threads:
        if pool is not None:
            pool.shutdown()
        _POOLS.pool, _POOLS.size = (
            concurrent.futures.ThreadPoolExecutor(threads, "host-kernel"),
            threads,
        )
    return _POOLS.pool
