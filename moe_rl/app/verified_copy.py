"""What is verified is what is loaded: a checkpoint's bytes checked at the moment they are used.

Checking a run directory and loading from it later leaves a window in which a file and its manifest
line can be swapped (a resume checks, then spends 20-40 s starting Ray and building the algorithm
before RLlib and DeepSpeed read the files). So nothing is loaded from the run directory itself:

    verified_copy(path, require_signature)   the checkpoint copied into a new private directory
        (mode 0700, under the system's temporary directory, whose sticky bit keeps others from
        renaming it), each file hashed from the very bytes written into the copy, against the
        manifest read once and, unless the run is trusted (--trust-run), its HMAC checked on those
        same bytes. RLlib's restore and DeepSpeed's load_checkpoint then read the copy only.
    read_verified(path, select, require_signature)   the bytes of the listed files select() picks (the policy's
        tensor files for `evaluate`), hashed in memory and returned: torch.load reads those bytes.

On a cluster whose learners run on other nodes, the copy must be where they can read it: set the
driver's TMPDIR to a directory on the shared disk that only you can write.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Dict, Tuple

from moe_rl.app.checkpoint_integrity import MANIFEST, CheckpointTree
from moe_rl.app.run_signature import is_signed_by_user, unsigned_reason
from moe_rl.core.errors import ConfigError


class UntrustedCheckpoint(ConfigError):
    """A checkpoint whose manifest is not signed with the user's key at the moment it is loaded."""


def _authentic(tree: CheckpointTree, require_signature: bool) -> Tuple[bytes, Dict[str, Any]]:
    data = tree.manifest_bytes()
    manifest = tree.manifest(data)
    if require_signature and not is_signed_by_user(manifest):
        raise UntrustedCheckpoint(f"{unsigned_reason(manifest, tree.name)}: a run from elsewhere or an edited "
                                  "one (checked as it was loaded)")
    return data, manifest


def verified_copy(path: str, require_signature: bool = True, parent: str = None) -> Tuple[str, Dict[str, Any]]:
    """(a private copy of the checkpoint at `path`, its manifest). The caller removes the copy
    (shutil.rmtree) once loaded. CheckpointError / UntrustedCheckpoint leave nothing behind."""
    copy = tempfile.mkdtemp(prefix="moe-rl-verified-", dir=parent)   # mode 0700
    try:
        with CheckpointTree(path) as tree:
            data, manifest = _authentic(tree, require_signature)
            tree.check_listing(manifest)
            listed = manifest["files"]
            for rel in sorted({"/".join(r.split("/")[:i]) for r in listed for i in range(1, r.count("/") + 1)}):
                os.mkdir(os.path.join(copy, rel), 0o700)
            for rel in sorted(listed):
                fd = os.open(os.path.join(copy, rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    tree.read_listed(rel, listed[rel], out.write)
            with open(os.path.join(copy, MANIFEST), "xb") as out:
                out.write(data)
    except BaseException:
        shutil.rmtree(copy, ignore_errors=True)
        raise
    return copy, manifest


def read_verified(path: str, select: Callable[[str], bool], require_signature: bool = False) -> Dict[str, bytes]:
    """{rel: bytes} of the listed files `select` picks, each hashed as read and checked against the
    manifest read in the same step (its signature too, if required)."""
    out: Dict[str, bytes] = {}
    with CheckpointTree(path) as tree:
        _, manifest = _authentic(tree, require_signature)
        for rel in sorted(r for r in manifest["files"] if select(r)):
            chunks: list = []
            tree.read_listed(rel, manifest["files"][rel], chunks.append)
            out[rel] = b"".join(chunks)
    return out
