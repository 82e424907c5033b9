"""Two GPUs in one process each run the fused kernels (cuDNN graph cache and handles are
per device): the same shapes on GPU 0, GPU 1 and GPU 0 again, forward and backward, each
against the float64 oracle (jax_sdpa.oracle) under its tolerance policy, with our XLA path
on the same device as the same-dtype yardstick. Run on a machine with >= 2 GPUs."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa import oracle  # noqa: E402


def run(impl, q, k, v, backward=True):
    """[out, dq, dk, dv] (the gradients of sum(out)), or [out]."""
    f = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                              implementation=impl)
    out = jax.jit(f)(q, k, v)
    if not backward:
        return [out]
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)),
                             argnums=(0, 1, 2)))(q, k, v)
    return [out] + list(grads)


def main():
    devices = jax.devices("gpu")
    print("devices:", devices)
    assert len(devices) >= 2, "needs two GPUs"
    rng = np.random.default_rng()
    shapes = ((2, 8, 1024, 128), (2, 2, 1024, 128), (2, 2, 1024, 128))
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ok = True
    for dev in (devices[0], devices[1], devices[0]):
        q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), dev) for x in host)
        for impl in ("cudnn", "cuda"):
            if impl == "cuda":  # decode shape for our own kernel
                q_i = q[:, :, :1]
            else:
                q_i = q
            backward = impl == "cudnn"  # the cuda call is a decode step: forward only
            try:
                got = run(impl, q_i, k, v, backward)
            except NotImplementedError as e:
                print(dev, impl, "not served:", e)
                continue
            xla = run("xla", q_i, k, v, backward)
            f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q_i, k, v)]
            want_out, _ = oracle.forward(*f64, mask="causal")
            grads = oracle.backward(*f64, np.ones(want_out.shape), mask="causal")
            want = [want_out, grads["dq"], grads["dk"], grads["dv"]]
            for i, (name, g, w, x) in enumerate(zip(("out", "dq", "dk", "dv"), got, want, xla)):
                # errors relative to the oracle's own magnitude
                err = oracle.max_rel_error(g, w, floor=oracle.OWN_MAGNITUDE)
                tol = oracle.tolerance("bfloat16", impl, grad=i > 0, xla_error=oracle.max_rel_error(
                    x, w, floor=oracle.OWN_MAGNITUDE))
                placed = list(g.devices())[0]
                good = placed == dev and np.isfinite(np.asarray(g, np.float32)).all() and err <= tol
                ok &= bool(good)
                print(f"{dev} {impl:5s} {name}: on {placed}, rel err {err:.2e} (tol {tol:.1e}) "
                      f"{'ok' if good else 'FAIL'}")
    print("two-GPU check:", "PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
