"""`make image`: the OCI layouts and docker archives it writes to target/images/, read blob by
blob here (no container engine, and not through umoci, which wrote them).

* The filter image: one layer, `application/vnd.oci.image.layer.v1.tar+gzip` (the compat layout
  Istio's fetcher reads from the last layer), whose only entry is `plugin.wasm`, byte-identical
  to the wasm build; no entrypoint.
* The native image (the dynamic module, to copy into an Envoy 1.40 image): no entrypoint, Env
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH=/usr/local/lib/envoy/dynamic_modules; one layer holding that
  folder's parents, the folder and libidempotency_filter.so (root's, 0644), byte-identical to
  `make build-native`'s, nothing else. The module is a glibc shared library Envoy's image can
  load: x86-64, no library but glibc's and libgcc_s, no glibc symbol newer than the Envoy
  image's. Unpacked, the real Envoy 1.40 loads it from there (ENVOY_DYNAMIC_MODULES_SEARCH_PATH
  the unpacked folder, as the image sets it) and a retry is replayed. envoy/Dockerfile.native
  copies that folder from that image into envoyproxy/envoy:v1.40.0 and sets the same variable.
* The idemstore image: User 65532:65532, Entrypoint /usr/local/bin/idemstore, Env
  IDEMSTORE_LISTEN=0.0.0.0:8380, ExposedPorts 8380/tcp; one layer holding the binary and the
  directories leading to it, nothing else; the binary is the static (musl) build, with no ELF
  interpreter and no shared libraries. Unpacked, it starts (as root: chrooted into the layer's
  tree as 65532:65532, nothing else in it) on its in-memory backend and answers GET /healthz.
* Every blob matches its digest, the layer tars are complete (end-of-archive blocks: umoci's
  own `insert` once left them out), the configs' diff_ids match the layers.
* The docker archives (`docker load`'s format) name the image as `make image` did, with the
  same config and layer as the layout.
* The compose file, the Istio manifests and envoy/Dockerfile.native refer to the images by the
  names `make image` gives them with its defaults.

Paths and names come from the environment (the Makefile passes them): IMAGES_DIR, IMAGE_TAG,
IMAGE_FILTER_REF, IMAGE_NATIVE_REF, IMAGE_IDEMSTORE_REF, IMAGE_IDEMSTORE_BIN, FILTER_WASM,
FILTER_MODULE, ENVOY_BIN. Without the layouts the
image tests skip, unless IMAGE_TEST is set (make test, make image-test), where they fail.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from support import harness as h
from support.checks import assert_executed, assert_replay_of


def _default_ref(name: str) -> str:
    """`make image`'s name for NAME with the Makefile's defaults of IMAGE_REGISTRY and IMAGE_TAG."""
    text = (h.ROOT / "Makefile").read_text()
    registry = re.search(r"^IMAGE_REGISTRY \?= (\S+)$", text, re.M)
    tag = re.search(r"^IMAGE_TAG \?= (\S+)$", text, re.M)
    assert registry and tag, "Makefile: no IMAGE_REGISTRY ?= / IMAGE_TAG ?= defaults"
    return f"{registry.group(1)}/{name}:{tag.group(1)}"


DEFAULT_FILTER_REF = _default_ref("idempotency-filter")
DEFAULT_NATIVE_REF = _default_ref("idempotency-filter-native")
DEFAULT_IDEMSTORE_REF = _default_ref("idemstore")

IMAGES_DIR = Path(os.environ.get("IMAGES_DIR") or h.ROOT / "target" / "images")
FILTER_REF = os.environ.get("IMAGE_FILTER_REF") or DEFAULT_FILTER_REF
NATIVE_REF = os.environ.get("IMAGE_NATIVE_REF") or DEFAULT_NATIVE_REF
IDEMSTORE_REF = os.environ.get("IMAGE_IDEMSTORE_REF") or DEFAULT_IDEMSTORE_REF
IMAGE_TAG = os.environ.get("IMAGE_TAG") or DEFAULT_FILTER_REF.rsplit(":", 1)[1]
IDEMSTORE_STATIC = Path(
    os.environ.get("IMAGE_IDEMSTORE_BIN")
    or h.ROOT / "target" / f"{os.uname().machine}-unknown-linux-musl" / "release" / "idemstore")

IDEMSTORE_PATH = "usr/local/bin/idemstore"
# The native image's module, where envoy/Dockerfile.native copies it from (docs/native.md).
NATIVE_MODULE_DIR = "usr/local/lib/envoy/dynamic_modules"
NATIVE_MODULE_PATH = f"{NATIVE_MODULE_DIR}/libidempotency_filter.so"
NATIVE_DOCKERFILE = h.ROOT / "envoy" / "Dockerfile.native"
# What the module may link: glibc's libraries and libgcc_s (Rust's unwinder), which the Ubuntu of
# envoyproxy/envoy's image has (its distroless variant has no libgcc_s).
NATIVE_NEEDED = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2",
                 "libpthread.so.0", "libdl.so.2", "librt.so.1"}
# The newest glibc symbol version the module may ask for: Ubuntu 22.04's glibc, the base of
# envoyproxy/envoy's images (Envoy's distribution/docker/Dockerfile-envoy). A module built on a
# newer glibc may ask for symbols that Envoy's image does not have, and fail to load there.
NATIVE_GLIBC_MAX = (2, 35)
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


# --------------------------------------------------------------------------------------------
# reading an OCI layout
# --------------------------------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Entry:
    name: str
    type: bytes
    mode: int
    uid: int
    gid: int
    mtime: int
    data: bytes | None  # a regular file's content


@dataclass
class Image:
    layout: Path
    manifest_digest: str
    manifest: dict
    config: dict
    layers: list[list[Entry]]  # each layer's tar entries, in order


def blob(layout: Path, descriptor: dict) -> bytes:
    """A blob of the layout, checked against the descriptor's digest and size."""
    algo, _, hexdigest = descriptor["digest"].partition(":")
    assert algo == "sha256", descriptor
    data = (layout / "blobs" / algo / hexdigest).read_bytes()
    assert sha256(data) == descriptor["digest"], f"{layout}: blob {descriptor['digest']} does not match its digest"
    assert len(data) == descriptor["size"], f"{layout}: blob {descriptor['digest']} is not {descriptor['size']} bytes"
    return data


def tar_entries(tar: bytes, where: str) -> list[Entry]:
    """The entries of an uncompressed layer tar, which must be complete: whole 512-byte blocks
    and the two zero blocks that end an archive (GNU tar refuses a layer without them)."""
    assert len(tar) % 512 == 0 and len(tar) >= 1024, f"{where}: {len(tar)} bytes, not whole tar blocks"
    assert tar[-1024:] == bytes(1024), f"{where}: no end-of-archive blocks"
    out = []
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as t:
        for m in t.getmembers():
            data = t.extractfile(m).read() if m.isreg() else None
            out.append(Entry(m.name, m.type, m.mode, m.uid, m.gid, m.mtime, data))
    return out


def read_image(layout: Path, tag: str) -> Image:
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    tagged = [m for m in index["manifests"]
              if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
    assert len(tagged) == 1, f"{layout}: {len(tagged)} manifests tagged {tag}: {index}"
    assert tagged[0]["mediaType"] == OCI_MANIFEST, tagged[0]
    manifest = json.loads(blob(layout, tagged[0]))
    assert manifest["schemaVersion"] == 2
    assert manifest["config"]["mediaType"] == OCI_CONFIG
    config = json.loads(blob(layout, manifest["config"]))
    layers = []
    for n, d in enumerate(manifest["layers"]):
        assert d["mediaType"] == OCI_LAYER_GZIP, d
        tar = gzip.decompress(blob(layout, d))
        assert sha256(tar) == config["rootfs"]["diff_ids"][n], f"{layout}: layer {n}: diff_id"
        layers.append(tar_entries(tar, f"{layout} layer {n}"))
    assert len(config["rootfs"]["diff_ids"]) == len(layers)
    return Image(layout, tagged[0]["digest"], manifest, config, layers)


def read_docker_archive(path: Path) -> tuple[dict, dict, list[bytes]]:
    """(manifest.json's one entry, the config, the layers uncompressed) of a docker-archive."""
    with tarfile.open(path) as t:
        def member(name: str) -> bytes:
            return t.extractfile(t.getmember(name)).read()
        (entry,) = json.loads(member("manifest.json"))
        config = json.loads(member(entry["Config"]))
        layers = []
        for name in entry["Layers"]:
            data = member(name)
            layers.append(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    return entry, config, layers


def elf_static(data: bytes) -> tuple[bool, str]:
    """Whether a 64-bit little-endian ELF executable runs without a dynamic loader: no
    PT_INTERP segment and no DT_NEEDED entry (a static-pie keeps a PT_DYNAMIC for its own
    relocations, with no libraries in it)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False, "not a 64-bit little-endian ELF file"
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 3:  # PT_INTERP
            interp = data[p_offset:p_offset + p_filesz].rstrip(b"\0").decode()
            return False, f"dynamically linked (interpreter {interp})"
        if p_type == 2:  # PT_DYNAMIC
            for off in range(p_offset, p_offset + p_filesz, 16):
                d_tag, _ = struct.unpack_from("<qQ", data, off)
                if d_tag == 0:
                    break
                if d_tag == 1:  # DT_NEEDED
                    return False, "needs shared libraries (DT_NEEDED)"
    return True, "static"


@dataclass
class Elf:
    type: int  # e_type: 3 is ET_DYN, a shared object
    machine: int  # e_machine: 62 is x86-64, 183 AArch64
    interp: bool  # a PT_INTERP segment (an executable's)
    needed: list[str]  # DT_NEEDED
    glibc: list[tuple[int, ...]]  # the GLIBC_x.y versions of .gnu.version_r
    exports: set[str]  # defined dynamic symbols


def elf_dynamic(data: bytes) -> Elf:
    """The dynamic-linking facts of a 64-bit little-endian ELF file, from its section headers."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF file"
    e_type, e_machine = struct.unpack_from("<HH", data, 0x10)
    (phoff, shoff) = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    interp = any(struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum))
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(strtab: int, off: int) -> str:
        start = sections[strtab][4] + off
        return data[start:data.index(b"\0", start)].decode()

    needed, glibc, exports = [], [], set()
    for _, sh_type, _, _, offset, size, link, info, _, entsize in sections:
        if sh_type == 6:  # SHT_DYNAMIC
            for off in range(offset, offset + size, 16):
                d_tag, d_val = struct.unpack_from("<qQ", data, off)
                if d_tag == 0:
                    break
                if d_tag == 1:  # DT_NEEDED
                    needed.append(string(link, d_val))
        elif sh_type == 0x6FFFFFFE:  # SHT_GNU_verneed: Verneed entries, each with its Vernaux
            off = offset
            for _ in range(info):
                _, vn_cnt, _, vn_aux, vn_next = struct.unpack_from("<HHIII", data, off)
                aux = off + vn_aux
                for _ in range(vn_cnt):
                    _, _, _, vna_name, vna_next = struct.unpack_from("<IHHII", data, aux)
                    name = string(link, vna_name)
                    if name.startswith("GLIBC_2"):
                        glibc.append(tuple(int(x) for x in name[len("GLIBC_"):].split(".")))
                    aux += vna_next
                off += vn_next
        elif sh_type == 11:  # SHT_DYNSYM
            for off in range(offset, offset + size, entsize):
                st_name, _, _, st_shndx = struct.unpack_from("<IBBH", data, off)
                if st_name and st_shndx:  # defined here, not imported
                    exports.add(string(link, st_name))
    return Elf(e_type, e_machine, interp, needed, glibc, exports)


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not pending and not stripped):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).strip().partition(" ")
        pending = ""
        out.append((word.upper(), rest.strip()))
    return out


def unpack(layer: list[Entry], rootfs: Path) -> None:
    """A layer's directories and regular files under rootfs, with their modes."""
    rootfs.mkdir()
    for e in layer:
        path = rootfs / e.name
        if e.type == tarfile.DIRTYPE:
            path.mkdir(exist_ok=True)
        else:
            assert e.type == tarfile.REGTYPE, e
            path.write_bytes(e.data)
        path.chmod(e.mode & 0o7777)
    rootfs.chmod(0o755)


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


def _image(name: str) -> Image:
    layout = IMAGES_DIR / name
    if not (layout / "index.json").is_file():
        if not os.environ.get("IMAGE_TEST"):
            pytest.skip(f"no image layout {layout}: `make image` builds it (`make image-test` builds and "
                        f"tests, as make test does)")
        pytest.fail(f"IMAGE_TEST is set but {layout} is missing: did `make image` run?", pytrace=False)
    return read_image(layout, IMAGE_TAG)


def same_as_build(data: bytes, build: Path, what: str) -> bool:
    """Whether the image holds `build`'s current bytes. Outside make test and make image-test
    (IMAGE_TEST unset), images older than the build (`make e2e` rebuilds the wasm, not the images)
    skip the test instead of failing it."""
    if data == build.read_bytes():
        return True
    if not os.environ.get("IMAGE_TEST"):
        pytest.skip(f"{what} is not the current {build}: the images predate the build (make image)")
    return False


@pytest.fixture(scope="module")
def filter_image() -> Image:
    return _image("idempotency-filter")


@pytest.fixture(scope="module")
def native_image() -> Image:
    return _image("idempotency-filter-native")


@pytest.fixture(scope="module")
def idemstore_image() -> Image:
    return _image("idemstore")


# --------------------------------------------------------------------------------------------
# the filter image
# --------------------------------------------------------------------------------------------


def test_filter_image_holds_plugin_wasm_only(filter_image):
    """One gzip'ed OCI layer whose only entry is plugin.wasm, a regular file with exactly the
    bytes of the wasm build: what Istio's fetcher (and Envoy Gateway's) extracts from the last
    layer of a compat image."""
    assert len(filter_image.layers) == 1, filter_image.manifest
    (entries,) = filter_image.layers
    assert [(e.name, e.type) for e in entries] == [("plugin.wasm", tarfile.REGTYPE)], entries
    wasm = Path(h.wasm_path())
    assert same_as_build(entries[0].data, wasm, "plugin.wasm"), f"plugin.wasm differs from {wasm}"
    assert (entries[0].uid, entries[0].gid) == (0, 0)


def test_filter_image_config(filter_image):
    """Nothing to run: no entrypoint or command, no user, no environment; a plain manifest (no
    index for Istio's fetcher to resolve by platform)."""
    cfg = filter_image.config
    assert cfg["os"] == "linux"
    inner = cfg.get("config") or {}
    for key in ("Entrypoint", "Cmd", "User", "Env", "ExposedPorts"):
        assert not inner.get(key), f"{key}: {inner.get(key)!r}"
    assert inner.get("Labels", {}).get("org.opencontainers.image.title") == "idempotency-filter"
    assert len(cfg.get("history", [])) == len(filter_image.layers)


# --------------------------------------------------------------------------------------------
# the native image
# --------------------------------------------------------------------------------------------


def image_arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)


def test_native_image_config(native_image):
    """Nothing to run (the image is copied from, not run): no entrypoint, command, user or port;
    the one variable an Envoy needs to find the module, pointing at its folder."""
    cfg = native_image.config
    assert cfg["os"] == "linux"
    assert cfg["architecture"] == image_arch()
    inner = cfg.get("config") or {}
    for key in ("Entrypoint", "Cmd", "User", "ExposedPorts", "WorkingDir", "Volumes"):
        assert not inner.get(key), f"{key}: {inner.get(key)!r}"
    assert inner["Env"] == [f"ENVOY_DYNAMIC_MODULES_SEARCH_PATH=/{NATIVE_MODULE_DIR}"]
    labels = inner.get("Labels", {})
    assert labels.get("org.opencontainers.image.title") == "idempotency-filter-native"
    assert labels.get("org.opencontainers.image.licenses") == "Apache-2.0"
    assert len(cfg.get("history", [])) == len(native_image.layers)


def test_native_image_holds_the_module_only(native_image):
    """One layer: the folders down to usr/local/lib/envoy/dynamic_modules (root's, 0755) and the
    module in it (root's, 0644: a library, read by whichever user Envoy runs as), nothing else.
    The module is `make build-native`'s, byte for byte: a glibc shared object of this machine
    that exports the module ABI's entry point and links nothing Envoy's image lacks."""
    assert len(native_image.layers) == 1, native_image.manifest
    (entries,) = native_image.layers
    names = [(e.name.rstrip("/"), e.type) for e in entries]
    parts = NATIVE_MODULE_DIR.split("/")
    folders = [("/".join(parts[:n]), tarfile.DIRTYPE) for n in range(1, len(parts) + 1)]
    assert names == [*folders, (NATIVE_MODULE_PATH, tarfile.REGTYPE)], names
    for e in entries:
        mode = 0o755 if e.type == tarfile.DIRTYPE else 0o644
        assert (e.uid, e.gid, e.mode & 0o7777) == (0, 0, mode), e
    module = entries[-1].data
    build = Path(h.native_module())
    assert same_as_build(module, build, NATIVE_MODULE_PATH), f"the module differs from {build}"
    elf = elf_dynamic(module)
    assert elf.type == 3 and not elf.interp, "not a shared object"
    assert elf.machine == {"amd64": 62, "arm64": 183}[native_image.config["architecture"]], elf.machine
    assert "envoy_dynamic_module_on_program_init" in elf.exports
    assert set(elf.needed) <= NATIVE_NEEDED, f"links more than glibc and libgcc_s: {elf.needed}"
    assert "libc.so.6" in elf.needed, "not a glibc build (a musl module cannot load into Envoy)"
    newest = max(elf.glibc)
    assert newest <= NATIVE_GLIBC_MAX, (
        f"the module asks for GLIBC_{'.'.join(map(str, newest))}, newer than the Envoy image's "
        f"{'.'.join(map(str, NATIVE_GLIBC_MAX))}: build it on an older glibc")


def test_module_from_the_native_image_runs_in_envoy(native_image, run_dir, tmp_path, upstream):
    """The module as unpacked from the layer (0644, in its folder, nothing else there) is the one
    Envoy 1.40 loads when ENVOY_DYNAMIC_MODULES_SEARCH_PATH is that folder (the image's variable,
    under the unpacked tree): a guarded request executes once and its retry is replayed."""
    rootfs = tmp_path / "rootfs"
    (entries,) = native_image.layers
    unpack(entries, rootfs)
    (env,) = native_image.config["config"]["Env"]
    name, _, folder = env.partition("=")
    search_path = rootfs / folder.lstrip("/")
    module = search_path / "libidempotency_filter.so"
    assert sorted(p.name for p in search_path.iterdir()) == [module.name]
    admin, port = h.free_port(), h.free_port()
    config = {"admin": {"address": {"socket_address": {"address": h.LOOPBACK, "port_value": admin}}},
              "static_resources": {
                  "listeners": [h.listener("api", port, [h.native_filter({"store": {"memory": True}})])],
                  "clusters": [h.static_cluster("upstream", upstream.port)]}}
    envoy = h.spawn_envoy_config(run_dir / "native-image", "envoy-native-image", config, admin,
                                 {"api": port}, env={name: str(search_path)})
    try:
        h.await_envoy(envoy)
        maps = Path(f"/proc/{envoy.proc.popen.pid}/maps").read_text()
        loaded = {line.split(None, 5)[5] for line in maps.splitlines()
                  if line.endswith("libidempotency_filter.so") and len(line.split(None, 5)) == 6}
        assert loaded == {str(module)}, loaded
        key = h.new_key()
        headers = {"idempotency-key": key, "content-type": "application/json"}
        first = h.request(port, "POST", "/orders", b'{"item":"book"}', headers)
        assert_executed(first)
        assert_replay_of(h.request(port, "POST", "/orders", b'{"item":"book"}', headers), first)
        assert upstream.count(key=key) == 1
        assert "idempotency: configured; store: memory" in envoy.log_text()
    finally:
        envoy.stop()


def test_dockerfile_native_copies_the_native_image():
    """envoy/Dockerfile.native: the module image by `make image`'s default name, then Envoy's
    official image of the Envoy this repository builds for (the Makefile's ENVOY_VERSION), with
    the module's folder copied from the first and the variable pointing at it; nothing else
    (no RUN, no ADD, no COPY from the build context)."""
    ins = dockerfile(NATIVE_DOCKERFILE)
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    assert args.get("MODULE_IMAGE") == DEFAULT_NATIVE_REF
    froms = [a for i, a in ins if i == "FROM"]
    version = re.search(r"^ENVOY_VERSION := (\S+)$", (h.ROOT / "Makefile").read_text(), re.M).group(1)
    assert froms == ["${MODULE_IMAGE} AS module", f"envoyproxy/envoy:v{version}"], froms
    assert not [i for i, _ in ins if i in ("RUN", "ADD", "USER", "ENTRYPOINT", "CMD")]
    folder = f"/{NATIVE_MODULE_DIR}/"
    assert [a for i, a in ins if i == "COPY"] == [f"--from=module {folder} {folder}"]
    assert [a for i, a in ins if i == "ENV"] == [f"ENVOY_DYNAMIC_MODULES_SEARCH_PATH=/{NATIVE_MODULE_DIR}"]
    ignore = NATIVE_DOCKERFILE.with_name(NATIVE_DOCKERFILE.name + ".dockerignore")
    kept = [l.strip() for l in ignore.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert kept == ["*"], f"{ignore}: the build context is to be empty"


def test_dockerfile_native_sets_what_the_image_sets(native_image):
    """The Envoy image of envoy/Dockerfile.native gets the native image's variable as it is (an
    image's ENV is not copied with its files)."""
    ins = dockerfile(NATIVE_DOCKERFILE)
    assert [a for i, a in ins if i == "ENV"] == native_image.config["config"]["Env"]


# --------------------------------------------------------------------------------------------
# the idemstore image
# --------------------------------------------------------------------------------------------


def test_idemstore_image_config(idemstore_image):
    """As documented (envoy/README.md, idemstore/Dockerfile): non-root 65532:65532, the binary as
    the entrypoint, listening on every interface of the container on 8380."""
    cfg = idemstore_image.config
    assert cfg["os"] == "linux"
    assert cfg["architecture"] == image_arch()
    inner = cfg["config"]
    assert inner["User"] == "65532:65532"
    assert inner["Entrypoint"] == ["/" + IDEMSTORE_PATH]
    assert not inner.get("Cmd")
    assert inner["Env"] == ["IDEMSTORE_LISTEN=0.0.0.0:8380"]
    assert inner["ExposedPorts"] == {"8380/tcp": {}}
    assert not inner.get("WorkingDir") and not inner.get("Volumes")
    assert len(cfg.get("history", [])) == len(idemstore_image.layers)


def test_idemstore_image_holds_the_static_binary_only(idemstore_image):
    """One layer: usr/, usr/local/, usr/local/bin/ and the binary (root's, 0755), nothing else
    (no shell, no libc, no /etc). The binary is the musl build, statically linked."""
    assert len(idemstore_image.layers) == 1, idemstore_image.manifest
    (entries,) = idemstore_image.layers
    names = [(e.name.rstrip("/"), e.type) for e in entries]
    assert names == [("usr", tarfile.DIRTYPE), ("usr/local", tarfile.DIRTYPE),
                     ("usr/local/bin", tarfile.DIRTYPE), (IDEMSTORE_PATH, tarfile.REGTYPE)], names
    for e in entries:
        assert (e.uid, e.gid, e.mode & 0o7777) == (0, 0, 0o755), e
    binary = entries[-1].data
    assert same_as_build(binary, IDEMSTORE_STATIC, IDEMSTORE_PATH), f"the binary differs from {IDEMSTORE_STATIC}"
    static, why = elf_static(binary)
    assert static, f"{IDEMSTORE_PATH}: {why}"


def test_layer_dates_are_fixed(filter_image, native_image, idemstore_image):
    """Every layer entry, the configs and their history carry one date (SOURCE_DATE_EPOCH, by
    default the last commit's): rebuilding the same inputs gives the same digests."""
    for image in (filter_image, native_image, idemstore_image):
        mtimes = {e.mtime for layer in image.layers for e in layer}
        assert len(mtimes) == 1, (image.layout, mtimes)
        created = {image.config["created"]} | {x["created"] for x in image.config.get("history", [])}
        assert len(created) == 1, (image.layout, created)


def test_idemstore_from_the_image_answers_healthz(idemstore_image, run_dir, tmp_path):
    """The binary as unpacked from the layer starts on its in-memory backend and answers GET
    /healthz. As root it runs chrooted into the unpacked layer (nothing but the binary there: no
    libc, no /etc, no /proc) as the image's user; otherwise directly. Stopped by PID."""
    rootfs = tmp_path / "rootfs"
    (entries,) = idemstore_image.layers
    unpack(entries, rootfs)
    port = h.free_port()
    listen = ["--listen", f"{h.LOOPBACK}:{port}"]
    argv = [str(rootfs / IDEMSTORE_PATH), *listen]
    chroot = shutil.which("chroot")
    if os.geteuid() == 0 and chroot:
        user = idemstore_image.config["config"]["User"]
        jailed = [chroot, f"--userspec={user}", str(rootfs), "/" + IDEMSTORE_PATH]
        probe = subprocess.run([*jailed, "--version"], capture_output=True, text=True, timeout=20)
        # chroot(8) exits 125 when it cannot chroot (no CAP_SYS_CHROOT in some containers).
        if probe.returncode != 125:
            assert probe.returncode == 0 and probe.stdout.startswith("idemstore "), probe
            argv = [*jailed, *listen]
    # The image's environment, with the address of this test instead of 0.0.0.0:8380.
    env = dict(e.split("=", 1) for e in idemstore_image.config["config"]["Env"])
    env["IDEMSTORE_LISTEN"] = f"{h.LOOPBACK}:{port}"
    proc = h.start("idemstore-image", argv, run_dir, env=env)
    try:
        h.await_idemstore(proc, port)
        status, body = h.http_get_status(port, "/healthz")
        assert status == 200, body
        assert proc.alive()
    finally:
        rc = proc.stop()
    assert rc == 0, f"idemstore exited with {rc} on SIGTERM\n{proc.describe()}"


# --------------------------------------------------------------------------------------------
# the docker archives
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,ref", [("idempotency-filter", FILTER_REF),
                                      ("idempotency-filter-native", NATIVE_REF),
                                      ("idemstore", IDEMSTORE_REF)])
def test_docker_archive(name, ref, request):
    """target/images/<name>.tar, docker load's format: named as make image named it, the
    layout's config and layer (compared uncompressed: the archive may store it either way)."""
    fixture = {"idempotency-filter": "filter_image", "idempotency-filter-native": "native_image",
               "idemstore": "idemstore_image"}[name]
    image = request.getfixturevalue(fixture)
    archive = IMAGES_DIR / f"{name}.tar"
    assert archive.is_file(), f"{archive}: missing"
    entry, config, layers = read_docker_archive(archive)
    assert entry["RepoTags"] == [ref]
    assert config["rootfs"]["diff_ids"] == image.config["rootfs"]["diff_ids"]
    assert config["config"] == image.config["config"]
    assert [sha256(l) for l in layers] == image.config["rootfs"]["diff_ids"]


# --------------------------------------------------------------------------------------------
# the names the deployment files use
# --------------------------------------------------------------------------------------------


def test_compose_and_istio_use_the_names_make_image_gives():
    """envoy/docker-compose.yaml runs idemstore as `make image` names it (after `docker load -i
    target/images/idemstore.tar`; `--build` builds the same name from idemstore/Dockerfile);
    envoy/istio/idemstore.yaml runs that image and envoy/istio/wasmplugin.yaml pulls the filter's
    (the README's render step puts the real registry in place of the default one)."""
    compose = yaml.safe_load((h.ROOT / "envoy" / "docker-compose.yaml").read_text())
    assert compose["services"]["idemstore"]["image"] == DEFAULT_IDEMSTORE_REF
    istio = h.ROOT / "envoy" / "istio"
    images = [c["image"]
              for d in yaml.safe_load_all((istio / "idemstore.yaml").read_text())
              if d and d.get("kind") == "Deployment" and d["metadata"]["name"] == "idemstore"
              for c in d["spec"]["template"]["spec"]["containers"]]
    assert images == [DEFAULT_IDEMSTORE_REF]
    (plugin,) = [d for d in yaml.safe_load_all((istio / "wasmplugin.yaml").read_text())
                 if d and d.get("kind") == "WasmPlugin"]
    assert plugin["spec"]["url"] == f"oci://{DEFAULT_FILTER_REF}"
