"""TLS for WAN connections: the agents' mutual-TLS contexts (TLS 1.3, certificates of the
deployment's CA), the peer's names from its certificate, and TLS failures as named errors."""

from __future__ import annotations

import asyncio
import ssl

from ..errors import ErrorCode, FatalHandshakeError

X509_V_ERR_HOSTNAME_MISMATCH = 62


def tls_error(exc: ssl.SSLError, what: str) -> FatalHandshakeError:
    """A TLS failure as a named, non-retryable handshake error."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_code == X509_V_ERR_HOSTNAME_MISMATCH:
        return FatalHandshakeError(f"{what}: certificate is for another node ({exc.verify_message})",
                                   ErrorCode.IDENTITY_MISMATCH)
    detail = getattr(exc, "verify_message", None) or exc.reason or str(exc) or type(exc).__name__
    return FatalHandshakeError(f"{what} refused: {detail}", ErrorCode.TLS_REFUSED)


def server_tls_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: a peer without a valid certificate is refused
    return ctx


def client_tls_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.check_hostname = True  # the peer's certificate must name the configured node
    return ctx


def peer_certificate_names(transport: asyncio.BaseTransport) -> set[str]:
    """CN and DNS SANs of the peer's verified certificate (empty without TLS)."""
    cert = transport.get_extra_info("peercert")
    if not cert:
        return set()
    names = {v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"}
    names |= {v for k, v in cert.get("subjectAltName", ()) if k == "DNS"}
    return names
