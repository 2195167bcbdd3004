import concurrent.futures
import socket
import ssl

import pytest

from support.certs import make_pki

TIMEOUT = 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["server", "client"])


def server_context(ca, cert_key) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # the default from Python 3.13 on
    ctx.load_verify_locations(cafile=ca)
    ctx.load_cert_chain(*cert_key)
    return ctx


def client_context(ca, cert_key) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED + check_hostname
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.load_verify_locations(cafile=ca)
    ctx.load_cert_chain(*cert_key)
    return ctx


def handshake(server_ctx, client_ctx, server_hostname):
    """Run both ends over a real loopback TCP connection, one per thread.

    Returns ``(server_outcome, client_outcome)``: the peer certificate dict on
    success, else the exception raised.  Each end also exchanges one byte so
    that a TLS 1.3 client learns about a rejection of its certificate (which
    the server only checks after the client considers the handshake done).
    """
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT)
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            conn.settimeout(TIMEOUT)
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                peer = tls.getpeercert()
                tls.sendall(b"s")
                tls.recv(1)
                return peer

        def connect():
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                    peer = tls.getpeercert()
                    tls.sendall(b"c")
                    if not tls.recv(1):
                        raise ConnectionError("server closed the connection")
                    return peer

        def outcome(future):
            try:
                return future.result()
            except Exception as exc:  # noqa: BLE001 - returned for assertions
                return exc

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            server = pool.submit(serve)
            client = pool.submit(connect)
            return outcome(server), outcome(client)


def subject_cn(peercert) -> str:
    return dict(rdn[0] for rdn in peercert["subject"])["commonName"]


@pytest.mark.parametrize("server_hostname", ["server", "127.0.0.1"])
def test_mutual_tls_with_good_certs(pki, server_hostname):
    server, client = handshake(
        server_context(pki["ca"], pki["server"]),
        client_context(pki["ca"], pki["client"]),
        server_hostname,
    )
    assert isinstance(server, dict), server
    assert isinstance(client, dict), client
    assert subject_cn(server) == "client"
    assert subject_cn(client) == "server"
    assert ("IP Address", "127.0.0.1") in client["subjectAltName"]


def test_rogue_client_cert_is_rejected(pki):
    server, client = handshake(
        server_context(pki["ca"], pki["server"]),
        client_context(pki["ca"], pki["rogue"]),
        "server",
    )
    assert isinstance(server, ssl.SSLCertVerificationError), server
    assert isinstance(client, (ssl.SSLError, ConnectionError)), client


def test_rogue_server_cert_is_rejected(pki):
    server, client = handshake(
        server_context(pki["ca"], pki["rogue"]),
        client_context(pki["ca"], pki["client"]),
        "rogue",
    )
    assert isinstance(client, ssl.SSLCertVerificationError), client
    assert isinstance(server, (ssl.SSLError, ConnectionError)), server


def test_cert_for_other_name_fails_hostname_check(pki):
    server, client = handshake(
        server_context(pki["ca"], pki["server"]),
        client_context(pki["ca"], pki["client"]),
        "client",
    )
    assert isinstance(client, ssl.SSLCertVerificationError), client
    assert "hostname" in str(client).lower()


def test_make_pki_rejects_bad_names(tmp_path):
    for names in (["ca"], ["rogue"], ["a/b"], ["x", "x"]):
        with pytest.raises(ValueError):
            make_pki(tmp_path, names)
