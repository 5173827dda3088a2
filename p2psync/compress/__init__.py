"""Per-piece codecs: none, fp16, int8 uniform, sketch8 (Canary's gradient sketch); error feedback."""

from p2psync.compress.codecs import (CODECS, Codec, ErrorFeedback, Fp16, Int8Uniform, NoCodec,
                                     Sketch8, get_codec)

__all__ = ["CODECS", "Codec", "ErrorFeedback", "Fp16", "Int8Uniform", "NoCodec", "Sketch8", "get_codec"]
