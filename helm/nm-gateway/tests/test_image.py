"""The offline image (helm/image/build-oci.py) from the binary under test: a consistent OCI
layout, the config the chart relies on (user 65532, `nm-gateway` on PATH), reproducible bytes,
and a root filesystem on which the binary really runs as that user and serves."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest
import yaml

from cluster import free_port, poll
from nmchart import CHART, REPO

BIN = os.environ.get("NM_GATEWAY_BIN", "")
BUILD = REPO / "helm" / "image" / "build-oci.py"
UID = 65532


def build(out: Path) -> Path:
    assert BIN and Path(BIN).is_file(), "set NM_GATEWAY_BIN to the nm-gateway binary under test"
    # --strip and gzip level 1 keep this quick on a debug binary; a real image uses the defaults.
    subprocess.run([sys.executable, str(BUILD), "--binary", BIN, "--out", str(out), "--strip", "--gzip-level", "1"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> dict:
    path = build(tmp_path_factory.mktemp("image") / "nm-gateway-oci.tar")
    with tarfile.open(path) as t:
        files = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    return {"path": path, "files": files}


def blob(files: dict, digest: str) -> bytes:
    algo, hexd = digest.split(":")
    data = files[f"blobs/{algo}/{hexd}"]
    assert hashlib.sha256(data).hexdigest() == hexd, f"{digest}: content does not match its digest"
    return data


def layer_tar(image: dict) -> tuple[dict, tarfile.TarFile]:
    files = image["files"]
    index = json.loads(files["index.json"])
    manifest = json.loads(blob(files, index["manifests"][0]["digest"]))
    config = json.loads(blob(files, manifest["config"]["digest"]))
    raw = gzip.decompress(blob(files, manifest["layers"][0]["digest"]))
    return {"index": index, "manifest": manifest, "config": config, "raw": raw}, tarfile.open(fileobj=io.BytesIO(raw))


def test_layout_is_consistent(image):
    files = image["files"]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    parts, _ = layer_tar(image)
    index, manifest = parts["index"], parts["manifest"]
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    entry = index["manifests"][0]
    assert entry["size"] == len(blob(files, entry["digest"]))
    assert manifest["config"]["size"] == len(blob(files, manifest["config"]["digest"]))
    layer = manifest["layers"][0]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert layer["size"] == len(blob(files, layer["digest"]))
    assert parts["config"]["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(parts["raw"]).hexdigest()]}
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert entry["annotations"]["io.containerd.image.name"] == f"nm-gateway:{version}"
    docker = json.loads(files["manifest.json"])
    assert docker == [{"Config": "blobs/sha256/" + manifest["config"]["digest"].split(":")[1], "RepoTags": [f"nm-gateway:{version}"], "Layers": ["blobs/sha256/" + layer["digest"].split(":")[1]]}]


def test_config_matches_the_dockerfile_and_the_chart(image):
    parts, _ = layer_tar(image)
    cfg = parts["config"]["config"]
    assert cfg["User"] == f"{UID}:{UID}"
    assert cfg["Entrypoint"] == ["nm-gateway"] and cfg["Cmd"] == ["serve"]
    assert "/usr/local/bin" in next(e for e in cfg["Env"] if e.startswith("PATH=")).split("=", 1)[1].split(":")
    assert cfg["WorkingDir"] == "/var/lib/nm-gateway"
    assert set(cfg["ExposedPorts"]) == {"8080/tcp", "50051/tcp"}
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["nm-gateway"]' in dockerfile and 'CMD ["serve"]' in dockerfile and "WORKDIR /var/lib/nm-gateway" in dockerfile


def test_root_filesystem(image):
    _, t = layer_tar(image)
    members = {m.name: m for m in t.getmembers()}
    exe = members["usr/local/bin/nm-gateway"]
    assert exe.isfile() and exe.mode & 0o111 and exe.uid == 0, "the binary is root-owned and not writable by the user"
    assert "nonroot:x:65532:65532:" in t.extractfile("etc/passwd").read().decode()
    assert b"BEGIN CERTIFICATE" in t.extractfile("etc/ssl/certs/ca-certificates.crt").read()
    assert members["tmp"].mode == 0o1777
    work = members["var/lib/nm-gateway"]
    assert (work.uid, work.gid) == (UID, UID)
    # Nothing but the binary, its libraries and a few files: no shell, no package manager.
    assert not any(n.endswith(("bin/sh", "bin/bash", "bin/busybox", "bin/apt", "bin/dpkg")) for n in members)


def test_reproducible(image, tmp_path):
    again = build(tmp_path / "again.tar")
    assert again.read_bytes() == image["path"].read_bytes()


def test_the_binary_runs_and_serves_on_the_image_as_its_user(image, tmp_path):
    """Run the unpacked layer the way a runtime would: chroot into it, the image's working
    directory and environment, uid/gid 65532, `nm-gateway` found on the image's PATH. The
    libraries resolve, --version is the chart's appVersion, and `serve` (the image's default
    command) starts with its default ./nm-data in the working directory and answers /health."""
    assert os.geteuid() == 0, "this test chroots into the image's root filesystem: run it as root (CI does)"
    root = tmp_path / "rootfs"
    parts, t = layer_tar(image)
    t.extractall(root, numeric_owner=True, filter="fully_trusted")
    cfg = parts["config"]["config"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    uid, gid = (int(x) for x in cfg["User"].split(":"))

    def enter() -> None:
        os.chroot(root)
        os.chdir(cfg["WorkingDir"])
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    argv = cfg["Entrypoint"]
    out = subprocess.run(argv + ["--version"], env=env, preexec_fn=enter, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["nm-gateway", yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]]

    port = free_port()
    serve_env = {**env, "NM_HTTP_ADDR": f"127.0.0.1:{port}", "NM_GRPC_ADDR": f"127.0.0.1:{free_port()}"}
    proc = subprocess.Popen(argv + cfg["Cmd"], env=serve_env, preexec_fn=enter, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode(errors="replace"))
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200

        poll("serve on the image to answer /health", healthy, 60)
        assert (root / "var/lib/nm-gateway/nm-data/nm-gateway.db").stat().st_uid == UID
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=45) == 0
