"""The sketch's bit packing (kernels.pack_bits / unpack_lookup, whole groups of eight codes
through a 64-bit word plus a tail) equals its plain-numpy twin bit for bit, at every width and
for every tail length."""

import numpy as np
import pytest

from p2psync.compress import kernels as K


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 1003])
def test_pack_and_unpack_equal_the_numpy_twins(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
    packed = np.zeros((n * bits + 7) // 8, np.uint8)
    K.pack_bits(codes, bits, packed)
    np.testing.assert_array_equal(packed, K.pack_bits_np(codes, bits))
    table = rng.standard_normal(1 << bits).astype(np.float32)
    out = np.empty(n, np.float32)
    K.unpack_lookup(packed, bits, table, out)
    np.testing.assert_array_equal(out, table[codes])
    np.testing.assert_array_equal(K.unpack_lookup_np(packed, bits, table, n), table[codes])


def test_the_byte_layout_is_little_endian_code_after_code():
    """Code i sits at bits [i*bits, (i+1)*bits): 3-bit codes 1..8 mod 8 written out by hand."""
    codes = np.array([1, 2, 3, 4, 5, 6, 7, 0], np.uint8)
    packed = np.zeros(3, np.uint8)
    K.pack_bits(codes, 3, packed)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert bytes(packed) == word.to_bytes(3, "little")
