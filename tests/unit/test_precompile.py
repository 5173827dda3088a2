"""precompile (run by scripts/install.sh): every numba kernel the runtime calls is compiled, with
the read-only inputs the wire delivers, so no node compiles on its event loop."""

from numba import types
from numba.core.registry import CPUDispatcher

from p2psync.cli.precompile import CODEC_SPECS, precompile
from p2psync.compress import CODECS
from p2psync.compress import kernels as codec_kernels
from p2psync.coordinator import zipline_kernels


def _kernels():
    for mod in (codec_kernels, zipline_kernels):
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.targetoptions.get("inline") != "always":
                yield name, obj


def test_every_kernel_the_runtime_calls_is_compiled_with_read_only_inputs_where_decoding():
    assert all(s.partition(":")[0] in CODECS for s in CODEC_SPECS)
    done = precompile()
    assert set(CODEC_SPECS) <= set(done)
    # compiled into their callers (and cached with them): _cell_table (bucketize_keyed's),
    # _keep_best (the ZipLine scans') and _block_scale (e3m0's two encoders); bucketize: the
    # tests' reference, no codec calls it
    inner = {"_cell_table", "_keep_best", "_block_scale", "bucketize"}
    missing = [n for n, k in _kernels() if not k.signatures and n not in inner]
    assert not missing, missing
    sigs = dict(_kernels())
    for name in ("lookup", "unpack_lookup"):  # decode: codes as they arrive, read-only
        assert any(isinstance(t, types.Array) and not t.mutable for sig in sigs[name].signatures for t in sig), name
