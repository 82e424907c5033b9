"""`jax.export` of functions that call jax_sdpa.

jax.export refuses custom calls whose targets have no compatibility guarantee, and the fused
implementations lower to our own FFI custom calls. Exporting them is sound where the artifact
runs against the same jax_sdpa build (its handlers are registered under the same names by
`import jax_sdpa`):

    exported = jax.export.export(jax.jit(f),
                                 disabled_checks=jax_sdpa.disabled_export_checks())(*args)
    blob = exported.serialize()        # needs `pip install flatbuffers`

Shapes must be concrete: a symbolic dimension raises NotImplementedError naming it.
"""

from __future__ import annotations

import jax

from jax_sdpa import _ext


def disabled_export_checks() -> list:
    """One `jax.export.DisabledSafetyCheck.custom_call(target)` per FFI target that this
    installation registers (the targets an exported jax_sdpa call can contain)."""
    return [jax.export.DisabledSafetyCheck.custom_call(target)
            for target in _ext.ffi_targets()]
