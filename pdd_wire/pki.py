"""The deployment PKI an agent generates for itself when no certificates are configured.

Without ``tls.cert`` (and without the explicit ``tls.allow_plaintext``), an agent runs mutual
TLS with a CA and node certificates it creates on first start in a private directory
(``tls.auto_dir``; default ``pdd-wire-pki-<uid>`` beside the engine socket): every agent of one
deployment on one machine (same uid, same directory) shares the CA, so they authenticate each
other, and a process of another uid, which cannot read the directory, cannot pose as a peer.
See ``proto/handshake.md`` §5.

Rules that make it safe:

* the directory is created 0700 and must be a real directory owned by this uid with no group or
  other permission bits (a directory an attacker created first is refused, not used), in a parent
  that nobody else can write either (``pdd_wire.rundir``: else they could swap it);
* every key file is created 0600 under an exclusive ``flock`` on ``lock`` in that directory and
  renamed into place, so two agents starting at once neither race nor read a half-written file;
* a node certificate that no longer verifies against the CA, does not name its node, or expires
  within 30 days is replaced.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import ConfigError
from .rundir import secure_dir, socket_dir_key

CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class Pki:
    cert: str
    key: str
    ca: str
    created: tuple[str, ...] = ()  # what this call generated (for the start-up log)


def default_dir(engine_socket: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(engine_socket)), f"pdd-wire-pki-{os.geteuid()}")


def private_dir(path: str, parent_key: str = "tls.auto_dir", *, create: bool = True) -> list[str]:
    """``path`` as a directory only this uid can enter; created 0700 when missing. ``parent_key``:
    what chose its parent (the engine socket's directory by default), named when that is unsafe.
    ``create=False`` (``--check``): read only, as :func:`~pdd_wire.rundir.secure_dir`; a safe
    directory of another (non-root) uid is a warning, returned: the agent must run as that uid."""
    # The parent too: whoever can write it can swap this directory for their own. It is the
    # engine socket's directory by default, created 0700 here when missing (pdd_wire.rundir).
    out = secure_dir(os.path.dirname(os.path.abspath(path)), parent_key, create=create)
    try:
        if create:
            os.mkdir(path, mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError("tls.auto_dir", f"cannot create {path!r}: {exc.strerror}") from exc
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if create:
            raise ConfigError("tls.auto_dir", f"cannot create {path!r}") from None
        return out
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError("tls.auto_dir", f"{path!r} is not a directory (a symlink is refused)")
    if st.st_mode & 0o077:
        raise ConfigError("tls.auto_dir", f"{path!r} has mode {stat.S_IMODE(st.st_mode):o}: must be 0700")
    if st.st_uid != os.geteuid():
        if not create and st.st_uid != 0:
            return out + [f"tls.auto_dir: {path!r} belongs to uid {st.st_uid}: the agent must run as that user"]
        raise ConfigError("tls.auto_dir", f"{path!r} belongs to uid {st.st_uid}, not this agent's "
                                          f"uid {os.geteuid()}: refusing keys someone else can replace")
    return out


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _make_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdd-wire deployment CA ({d})"[:64])])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(d / "ca.key", _key_pem(key))
    _write_private(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _make_leaf(d: Path, stem: str, name: str, ca: x509.Certificate, ca_key) -> None:
    key = _new_key()
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=LEAF_DAYS), ca.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(d / f"{stem}.key", _key_pem(key))
    _write_private(d / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(d: Path):
    try:
        cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    except (OSError, ValueError, TypeError):
        return None
    if cert.public_key() != key.public_key():
        return None
    if cert.not_valid_after_utc - _now() < RENEW_BEFORE:
        return None
    return cert, key


def _leaf_ok(d: Path, stem: str, name: str, ca: x509.Certificate) -> bool:
    try:
        cert = x509.load_pem_x509_certificate((d / f"{stem}.pem").read_bytes())
        key = serialization.load_pem_private_key((d / f"{stem}.key").read_bytes(), None)
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except (OSError, ValueError, TypeError, x509.ExtensionNotFound, InvalidSignature):
        return False
    return (name in names and cert.public_key() == key.public_key()
            and cert.not_valid_after_utc - _now() >= RENEW_BEFORE)


def ensure(dirpath: str, site: str, node: str, parent_key: str = "tls.auto_dir") -> Pki:
    """The CA and this node's certificate in ``dirpath``, generated where missing or unusable.
    Safe to call from several agents at once (one ``flock`` serialises them)."""
    private_dir(dirpath, parent_key)
    d = Path(os.path.abspath(dirpath))
    stem = f"{site}.{node}"
    created: list[str] = []
    fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        loaded = _load_ca(d)
        if loaded is None:
            loaded = _make_ca(d)
            created.append("ca")
        ca, ca_key = loaded
        if not _leaf_ok(d, stem, node, ca):
            _make_leaf(d, stem, node, ca, ca_key)
            created.append(stem)
    finally:
        os.close(fd)  # releases the lock
    return Pki(cert=str(d / f"{stem}.pem"), key=str(d / f"{stem}.key"), ca=str(d / "ca.pem"), created=tuple(created))


def _pem_certs(key: str, path: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{path!r} is not a PEM certificate file ({exc})") from None
    if not certs:
        raise ConfigError(key, f"{path!r} holds no certificate")
    return certs


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _issued(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        child.verify_directly_issued_by(parent)
        return True
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False


def check_files(cert: str, key: str, ca: str) -> None:
    """What TLS would find wrong with configured files, found before the agent starts (and by
    ``--check``), each a ConfigError naming its key: a file that is not PEM, a key that is not
    the certificate's, a ``tls.ca`` without a root CA (Python's TLS needs the self-signed one), a
    certificate that ``tls.ca`` did not sign (through the intermediates ``tls.cert`` holds, in
    any order) or one outside its validity."""
    cas = _pem_certs("tls.ca", ca)
    if not any(_is_ca(c) and c.issuer == c.subject for c in cas):
        raise ConfigError("tls.ca", f"{ca!r} holds no root CA certificate (self-signed, basicConstraints CA:TRUE): "
                                    "it must hold the CA that signed the nodes' certificates (with its "
                                    "intermediates, if any), not a node's own")
    chain = _pem_certs("tls.cert", cert)
    try:
        private = serialization.load_pem_private_key(Path(key).read_bytes(), None)
        mine = chain[0].public_key() == private.public_key()
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError("tls.key", f"{key!r} is not an unencrypted PEM private key ({exc})") from None
    if not mine:
        raise ConfigError("tls.key", f"{key!r} is not the key of the certificate in tls.cert ({cert!r})")
    leaf, now = chain[0], _now()
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise ConfigError("tls.cert", f"{cert!r} is valid from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                                      f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now")
    # From the leaf up: through the file's intermediates (any order), to a certificate of tls.ca.
    at, rest = leaf, list(chain[1:])
    for _ in range(len(chain)):
        if any(_issued(at, c) for c in cas):
            return
        up = next((c for c in rest if _issued(at, c)), None)
        if up is None:
            break
        rest.remove(up)
        at = up
    raise ConfigError("tls.cert", f"{cert!r} ({leaf.subject.rfc4514_string()}) does not chain to tls.ca ({ca!r}) "
                                  f"through the certificates the file holds (stopped at one issued by "
                                  f"{at.issuer.rfc4514_string()}): peers that trust tls.ca would refuse it; "
                                  "it is not signed by tls.ca")


def der_fingerprint(der: bytes) -> str:
    """``sha256:<hex>`` of a certificate's DER bytes: what a fleet member registers and its
    peers require in the handshake (proto/handshake.md §4)."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def cert_fingerprint(pem_path: str) -> str:
    """The fingerprint of the (first) certificate in a PEM file."""
    cert = x509.load_pem_x509_certificate(Path(pem_path).read_bytes())
    return der_fingerprint(cert.public_bytes(serialization.Encoding.DER))


def peer_fingerprint(transport) -> str:
    """The fingerprint of the certificate the other end of a TLS ``transport`` presented ("" without TLS)."""
    sslobj = transport.get_extra_info("ssl_object")
    der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
    return der_fingerprint(der) if der else ""


def tls_files(config) -> Pki | None:
    """The certificate, key and CA an agent runs TLS with: configured, or generated in
    ``tls.auto_dir``; None only with ``tls.allow_plaintext``."""
    tls = config.tls
    if tls.mode == "files":
        return Pki(cert=tls.cert, key=tls.key, ca=tls.ca)
    if tls.mode == "plaintext":
        return None
    path, key = _auto_dir(config)
    return ensure(path, config.site, config.node, parent_key=key)


def _auto_dir(config) -> tuple[str, str]:
    """The generated PKI's directory, and what chose its parent (named when that is unsafe)."""
    if config.tls.auto_dir:
        return config.tls.auto_dir, "tls.auto_dir"
    return default_dir(config.listen.engine_socket), socket_dir_key(config.listen.engine_socket)


def check_dirs(config) -> list[str]:
    """``--check``: the directory rule the agent applies at start (pdd_wire.rundir) to the engine
    socket's directory and the generated PKI's, read only (nothing is created); a ConfigError
    names the key or environment variable that chose the unsafe directory. Returns warnings: a
    safe directory of another (non-root) uid, which the agent must then run as."""
    sock = config.listen.engine_socket
    out = secure_dir(os.path.dirname(os.path.abspath(sock)), socket_dir_key(sock), create=False)
    if config.tls.mode != "auto":
        return out
    path, key = _auto_dir(config)
    # Once each: by default the PKI's parent is the socket's directory, checked (and warned of) twice.
    return list(dict.fromkeys(out + private_dir(path, key, create=False)))


def log_tls_mode(log, config, pki: Pki | None) -> None:
    if pki is None:
        log.warning("PLAINTEXT WAN: peers are NOT authenticated and traffic is NOT encrypted; any process "
                    "that can reach listen.wan can pose as a peer and take over its session "
                    "(tls.allow_plaintext = true)", wan=config.listen.wan)
    elif config.tls.mode == "auto":
        log.info("mutual TLS with the generated deployment PKI", dir=os.path.dirname(pki.ca),
                 generated=list(pki.created))
    else:
        log.info("mutual TLS with the configured certificates", ca=pki.ca)
