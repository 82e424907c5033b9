"""Two GPUs in one process each run the fused kernels (cuDNN graph cache and handles are
per device): the same shapes on GPU 0, GPU 1 and GPU 0 again, forward and backward,
each against XLA on the same device. Run on a machine with >= 2 GPUs."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_sdpa  # noqa: E402


def run(impl, q, k, v):
    f = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                              implementation=impl)
    out = jax.jit(f)(q, k, v)
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
            try:
                got = run(impl, q_i, k, v) if impl == "cudnn" else [jax.jit(
                    lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
                        q, k, v, implementation="cuda"))(q_i, k, v)]
            except NotImplementedError as e:
                print(dev, impl, "not served:", e)
                continue
            want = run("xla", q_i, k, v)[:len(got)] if impl == "cudnn" else [jax.jit(
                lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
                    q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                    implementation="xla"))(q_i, k, v)]
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                g32, w32 = (np.asarray(x.astype(jnp.float32)) for x in (g, w))
                err = np.max(np.abs(g32 - w32)) / max(np.max(np.abs(w32)), 1e-6)
                placed = list(g.devices())[0]
                good = placed == dev and np.isfinite(g32).all() and err < 3e-2
                ok &= bool(good)
                print(f"{dev} {impl:5s} {name}: on {placed}, rel err {err:.2e} "
                      f"{'ok' if good else 'FAIL'}")
    print("two-GPU check:", "PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
