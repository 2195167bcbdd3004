"""Sans-IO wire protocol: frames, message bodies, handshake rules. See ``proto/``."""

from .frame import (
    FRAME_VERSION,
    HEADER_SIZE,
    INLINE_MAX,
    MAGIC,
    Flags,
    Frame,
    FrameReader,
    FrameType,
    Header,
    Lane,
    encode,
    encode_bytes,
    payload_checksum,
)
from .messages import PROTOCOL_VERSION, decode_body, encode_body

__all__ = ["FRAME_VERSION", "HEADER_SIZE", "MAGIC", "Flags", "Frame", "FrameReader", "FrameType", "Header",
           "Lane", "encode", "encode_bytes", "payload_checksum", "PROTOCOL_VERSION", "decode_body",
           "encode_body", "INLINE_MAX"]
