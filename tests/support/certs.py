"""Throwaway PKI for mutual-TLS tests, made with the ``openssl`` CLI (OpenSSL 3).

All keys are EC P-256 and all certificates are valid for one day, so a PKI
for a handful of names takes well under a second.  Certificates carry the
extensions Python's ``ssl.VERIFY_X509_STRICT`` (the default from Python 3.13
on) insists on: critical basicConstraints, keyUsage, subject and authority key
identifiers.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

__all__ = ["make_pki"]

_OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"

# Our own config so the result does not depend on the system openssl.cnf
# (whose default x509 extensions would clash with ours).
_CONFIG = """\
[req]
distinguished_name = dn

[dn]

[ca_ext]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[leaf_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""

_RESERVED = {"ca", "rogue", "rogue_ca"}
# Usable both as a CN in -subj (no '/', '=', '+') and as a DNS SAN.
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def _openssl(*args: str | pathlib.Path) -> None:
    proc = subprocess.run([_OPENSSL, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{proc.stderr}")


def _new_ca(dirpath: pathlib.Path, stem: str, cn: str, config: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key = dirpath / f"{stem}.pem", dirpath / f"{stem}.key"
    _openssl(
        "req", "-x509", "-new", "-config", config, "-extensions", "ca_ext",
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc",
        "-subj", f"/CN={cn}", "-days", "1", "-keyout", key, "-out", cert,
    )
    return cert, key


def _new_leaf(
    dirpath: pathlib.Path, name: str, ca: tuple[pathlib.Path, pathlib.Path], config: pathlib.Path
) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key = dirpath / f"{name}.pem", dirpath / f"{name}.key"
    ca_cert, ca_key = ca
    # req -CA signs the new key's certificate with the CA directly, no CSR file.
    _openssl(
        "req", "-new", "-config", config, "-extensions", "leaf_ext",
        "-CA", ca_cert, "-CAkey", ca_key,
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc",
        "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name},IP:127.0.0.1",
        "-days", "1", "-keyout", key, "-out", cert,
    )
    return cert, key


def make_pki(dirpath: pathlib.Path, names: list[str]) -> dict:
    """Create a test CA and one key/certificate pair per name in ``dirpath``.

    Each leaf certificate has CN=name, subjectAltName ``DNS:name, IP:127.0.0.1``
    and both serverAuth and clientAuth extended key usage, so any of them can
    serve either end of a mutual-TLS connection.  A second, unrelated "rogue"
    CA signs one more leaf, ``rogue``, for negative tests.

    Returns:
        ``{"ca": ca_cert_path, name: (cert_path, key_path), ...,
        "rogue": (cert_path, key_path), "rogue_ca": rogue_ca_cert_path}``,
        all :class:`pathlib.Path`.  Certificates and keys are PEM.

    Raises:
        ValueError: a name is reserved (``ca``, ``rogue``, ``rogue_ca``),
            duplicated, or not a plain DNS-style label.
        RuntimeError: an ``openssl`` command failed (its stderr is included).
    """
    for name in names:
        if name in _RESERVED or not _NAME.fullmatch(name):
            raise ValueError(f"unusable certificate name: {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate certificate names: {names!r}")

    dirpath = pathlib.Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    config = dirpath / "openssl.cnf"
    config.write_text(_CONFIG)

    ca = _new_ca(dirpath, "ca", "pdd-wire test CA", config)
    rogue_ca = _new_ca(dirpath, "rogue_ca", "pdd-wire rogue CA", config)
    pki: dict = {"ca": ca[0], "rogue_ca": rogue_ca[0]}
    for name in names:
        pki[name] = _new_leaf(dirpath, name, ca, config)
    pki["rogue"] = _new_leaf(dirpath, "rogue", rogue_ca, config)
    return pki
