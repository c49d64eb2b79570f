#!/usr/bin/env python3
"""Assemble the nm-gateway container image without a container engine.

The real image is built from the repository's Dockerfile (`docker build .`). Where no engine
runs (this project's machines), this script lays out the same runtime image from a binary
already built: the binary, exactly the shared libraries it loads (found with ldd, the dynamic
loader included), the CA bundle, /etc/passwd and /etc/group with the non-root user 65532, a
world-writable /tmp and a working directory owned by that user. It writes one layer and an OCI
image layout (oci-layout, index.json, blobs/sha256/...) with a Docker-compatible manifest.json
beside it, packed as a tar:

    helm/image/build-oci.py --binary target/dist/nm-gateway --out target/nm-gateway-oci.tar

Load it with `docker load -i FILE`, `podman load -i FILE` or
`skopeo copy oci-archive:FILE docker://REGISTRY/nm-gateway:TAG`. The output is reproducible:
same inputs, same bytes (every timestamp is SOURCE_DATE_EPOCH, default 0).

The image config matches the Dockerfile's runtime stage: User 65532:65532, Entrypoint
["nm-gateway"] found on PATH, Cmd ["serve"], WorkingDir /var/lib/nm-gateway, ports 8080 and 50051.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

UID = GID = 65532
WORKDIR = "/var/lib/nm-gateway"
BIN_PATH = "/usr/local/bin/nm-gateway"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}

PASSWD = "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = "root:x:0:\nnonroot:x:65532:\n"
# glibc's resolver reads this; without it the default order is fine too, but say it.
NSSWITCH = "passwd: files\ngroup: files\nhosts: files dns\n"


def shared_libraries(binary: Path) -> list[str]:
    """Absolute paths of every library the binary loads, the dynamic loader included."""
    out = subprocess.run(["ldd", str(binary)], check=True, capture_output=True, text=True).stdout
    if "not a dynamic executable" in out or "statically linked" in out:
        return []
    libs = []
    for line in out.splitlines():
        line = line.strip()
        if "=> not found" in line:
            raise SystemExit(f"build-oci: {binary}: missing library: {line}")
        m = re.match(r"^(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            libs.append(m.group(1))
    return sorted(set(libs))


class Layer:
    """A deterministic tar: entries sorted by path, fixed times and owners."""

    def __init__(self, mtime: int):
        self.mtime = mtime
        self.entries: dict[str, tuple[tarfile.TarInfo, bytes | None]] = {}

    def _info(self, path: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0) -> tarfile.TarInfo:
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, self.mtime
        info.uname = info.gname = ""
        return info

    def dir(self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent.lstrip("/") not in self.entries:
                self.entries[parent.lstrip("/")] = (self._info(parent, tarfile.DIRTYPE, 0o755), None)
        self.entries[path.strip("/")] = (self._info(path, tarfile.DIRTYPE, mode, uid, gid), None)

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.dir(str(Path(path).parent))
        info = self._info(path, tarfile.REGTYPE, mode)
        info.size = len(data)
        self.entries[path.lstrip("/")] = (info, data)

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            for name in sorted(self.entries):
                info, data = self.entries[name]
                t.addfile(info, io.BytesIO(data) if data is not None else None)
        return buf.getvalue()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def build(binary: Path, out: Path, tag: str, version: str, strip: bool, gzip_level: int, ca_bundle: Path) -> dict:
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    created = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    layer = Layer(mtime)
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "nm-gateway"
        shutil.copyfile(binary, exe)
        if strip:
            subprocess.run(["strip", "--strip-debug", str(exe)], check=True)
        layer.file(BIN_PATH, exe.read_bytes(), 0o755)
    for lib in shared_libraries(binary):
        layer.file(lib, Path(lib).resolve().read_bytes(), 0o755)
    layer.file(CA_BUNDLE, ca_bundle.read_bytes())
    layer.file("/etc/passwd", PASSWD.encode())
    layer.file("/etc/group", GROUP.encode())
    layer.file("/etc/nsswitch.conf", NSSWITCH.encode())
    layer.dir("/tmp", 0o1777)
    layer.dir("/home/nonroot", 0o750, UID, GID)
    layer.dir(WORKDIR, 0o750, UID, GID)

    tar = layer.tar()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", compresslevel=gzip_level, mtime=0) as g:
        g.write(tar)
    blob = gz.getvalue()

    config = {
        "created": created,
        "architecture": ARCH.get(platform.machine(), platform.machine()),
        "os": "linux",
        "config": {
            "User": f"{UID}:{GID}",
            "Entrypoint": ["nm-gateway"],
            "Cmd": ["serve"],
            "Env": [PATH_ENV, f"SSL_CERT_FILE={CA_BUNDLE}"],
            "WorkingDir": WORKDIR,
            "ExposedPorts": {"8080/tcp": {}, "50051/tcp": {}},
            "Labels": {
                "org.opencontainers.image.title": "nm-gateway",
                "org.opencontainers.image.version": version,
                "org.opencontainers.image.licenses": "Apache-2.0",
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [sha256(tar)]},
        "history": [{"created": created, "created_by": "helm/image/build-oci.py"}],
    }
    config_bytes = canonical(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha256(blob), "size": len(blob)}],
        "annotations": {"org.opencontainers.image.version": version},
    }
    manifest_bytes = canonical(manifest)
    name, _, ref = tag.rpartition(":")
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": sha256(manifest_bytes),
                "size": len(manifest_bytes),
                "platform": {"architecture": config["architecture"], "os": "linux"},
                "annotations": {"org.opencontainers.image.ref.name": ref, "io.containerd.image.name": tag},
            }
        ],
    }
    blobs = {d: b for d, b in ((sha256(config_bytes), config_bytes), (sha256(manifest_bytes), manifest_bytes), (sha256(blob), blob))}
    docker_manifest = [
        {
            "Config": "blobs/sha256/" + sha256(config_bytes).split(":")[1],
            "RepoTags": [tag],
            "Layers": ["blobs/sha256/" + sha256(blob).split(":")[1]],
        }
    ]
    archive = Layer(mtime)
    archive.file("/oci-layout", canonical({"imageLayoutVersion": "1.0.0"}))
    archive.file("/index.json", canonical(index))
    archive.file("/manifest.json", canonical(docker_manifest))
    for digest, data in blobs.items():
        archive.file("/blobs/sha256/" + digest.split(":")[1], data)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(out.suffix + ".tmp")
    tmp_out.write_bytes(archive.tar())
    tmp_out.replace(out)
    return {"manifest": sha256(manifest_bytes), "config": sha256(config_bytes), "layer": sha256(blob), "size": out.stat().st_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", required=True, type=Path, help="the nm-gateway binary (cargo build --profile dist for a real image)")
    ap.add_argument("--out", required=True, type=Path, help="the OCI archive to write (.tar)")
    ap.add_argument("--tag", default=None, help="image name:tag (default nm-gateway:<binary --version>)")
    ap.add_argument("--strip", action="store_true", help="drop the binary's debug sections (strip --strip-debug)")
    ap.add_argument("--gzip-level", type=int, default=6, choices=range(1, 10), metavar="1-9")
    ap.add_argument("--ca-bundle", type=Path, default=Path(CA_BUNDLE))
    args = ap.parse_args()
    if not args.binary.is_file():
        print(f"build-oci: no binary at {args.binary}", file=sys.stderr)
        return 2
    version = subprocess.run([str(args.binary), "--version"], check=True, capture_output=True, text=True).stdout.split()[-1]
    tag = args.tag or f"nm-gateway:{version}"
    result = build(args.binary, args.out, tag, version, args.strip, args.gzip_level, args.ca_bundle)
    print(f"{args.out}: {tag} manifest {result['manifest']} ({result['size']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
