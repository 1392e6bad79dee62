#!/usr/bin/env python3
"""Make what a TLS + node-authenticated Flower deployment needs, with no tool but Python's
`cryptography` (which Flower itself depends on):

    OUT/certificates/ca.crt        the CA every SuperNode and `flwr` trusts (copy to each machine)
    OUT/certificates/ca.key        the CA's key (keep it off the client machines)
    OUT/certificates/server.pem    the SuperLink's certificate, for every --host name/IP given
    OUT/certificates/server.key    its key (stays on the SuperLink machine)
    OUT/keys/node-<i>              SuperNode i's private key, OpenSSH EC P-384 (to machine i only)
    OUT/keys/node-<i>.pub          its public key: register it with `flwr supernode register`

    python server/make_credentials.py --out credentials --nodes 3 --host 10.0.0.5 --host superlink.lan

Refuses to touch an existing OUT; writes into a scratch folder renamed into place at the end.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedsd"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_tls(out: Path, hosts: list[str]) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca = (x509.CertificateBuilder().subject_name(_name("fedsd CA")).issuer_name(_name("fedsd CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    (out / "certificates").mkdir()
    _write(out / "certificates" / "ca.crt", ca.public_bytes(serialization.Encoding.PEM))
    _write(out / "certificates" / "ca.key", _pem_key(ca_key), private=True)
    _write(out / "certificates" / "server.pem", cert.public_bytes(serialization.Encoding.PEM))
    _write(out / "certificates" / "server.key", _pem_key(key), private=True)


def make_node_keys(out: Path, nodes: int, first: int = 0) -> None:
    """EC P-384 key pairs in OpenSSH format, the form flower-supernode and `flwr supernode
    register` read."""
    (out / "keys").mkdir(exist_ok=True)
    for i in range(first, first + nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
        _write(out / "keys" / f"node-{i}", pem, private=True)
        _write(out / "keys" / f"node-{i}.pub", key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + f" fedsd-node-{i}\n".encode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a new folder")
    p.add_argument("--nodes", type=int, required=True, help="SuperNode key pairs to make (>= 1)")
    p.add_argument("--host", action="append", default=[],
                   help="a name or IP address clients use to reach the SuperLink (repeatable); "
                        "localhost and 127.0.0.1 are always included")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.nodes < 1:
        p.error(f"--nodes: must be >= 1, got {args.nodes}")
    if out.exists():
        p.error(f"--out: {out} exists; choose a new folder (credentials are never overwritten)")
    hosts = list(dict.fromkeys(args.host + ["localhost", "127.0.0.1"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        make_tls(scratch, hosts)
        make_node_keys(scratch, args.nodes)
        os.replace(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"credentials for a SuperLink at {', '.join(hosts)} and {args.nodes} SuperNodes in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
