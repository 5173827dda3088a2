"""Per-piece codecs: none, fp16, int8 uniform, sketch8 (Canary's gradient sketch; sketch8p: its
paper-exact variant), topk (sparsification, always with error feedback), e3m0 (4-bit floats, a scale
per block; e3m0:sr rounds stochastically); error feedback."""

from p2psync.compress.base import Codec
from p2psync.compress.codecs import (CODECS, ErrorFeedback, Fp16, Int8Uniform, NoCodec, Sketch8,
                                     Sketch8Paper, codec_usage, get_codec)
from p2psync.compress.e3m0 import E3M0
from p2psync.compress.topk import DEFAULT_FRACTION, TopK

__all__ = ["CODECS", "Codec", "DEFAULT_FRACTION", "E3M0", "ErrorFeedback", "Fp16", "Int8Uniform", "NoCodec",
           "Sketch8", "Sketch8Paper", "TopK", "codec_usage", "get_codec"]
