"""Sign and verify published bundle folders with OpenSSF model-signing (offline, EC key).

Each bundle folder of the Hub tree (``aimodel/<bundle>/``, ``<target>/<bundle>/``) gets
``<bundle>.sig`` inside it: a Sigstore bundle whose DSSE payload lists the sha256 of every other
file of the folder — the ``.aimodel`` (or product), ``export.json``, ``gate.json``, the vocab and
the provenance statement ``<bundle>.intoto.json``. The public key is published once, at the
tree's root, as ``signing-key.pub``; its sha256 (``sha256sum signing-key.pub``) is the key id
model-signing writes into every signature, and what the card and receipt show. A user checks a
downloaded folder with the library's own command::

    model_signing verify key aimodel/<bundle> --signature aimodel/<bundle>/<bundle>.sig --public_key signing-key.pub

The private key is a PEM EC key (P-256/384/521) named by ``$RECURRENT_COREAI_SIGNING_KEY`` (a path; an
encrypted key's password in ``$RECURRENT_COREAI_SIGNING_KEY_PASSWORD``). Neither the key, its path nor the
password is printed or written anywhere. Without the variable signing is skipped and the
output says so. Make a key with::

    openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out signing-key.pem

Keyless signing in CI (not runnable on this offline machine: it needs an OIDC token and
Sigstore's Fulcio/Rekor): on GitHub Actions with ``permissions: id-token: write``, sign with
``model_signing.signing.Config().use_sigstore_signer(use_ambient_credentials=True)`` — or
``model_signing sign sigstore aimodel/<bundle> --signature aimodel/<bundle>/<bundle>.sig
--use_ambient_credentials`` — and verify against the workflow identity instead of a key:
``model_signing verify sigstore aimodel/<bundle> --signature aimodel/<bundle>/<bundle>.sig
--identity https://github.com/<owner>/<repo>/.github/workflows/<workflow>.yml@refs/heads/main
--identity_provider https://token.actions.githubusercontent.com``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from recurrent_coreai.util import env
from recurrent_coreai.util.errors import PipelineError
from recurrent_coreai.util.fsutil import first_difference, sha256_file, tree_files

KEY_ENV = "RECURRENT_COREAI_SIGNING_KEY"  # old name RWKV7_SIGNING_KEY still read (util/env.py)
PASSWORD_ENV = "RECURRENT_COREAI_SIGNING_KEY_PASSWORD"  # old name RWKV7_SIGNING_KEY_PASSWORD
PUBLIC_KEY = "signing-key.pub"  # at the root of the Hub tree
SUFFIX = ".sig"
KEY = "the signing key"  # how errors name the private key: never by its path
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing accepts
CHANGED_FIX = ("the bundle changed after it was signed: do not use this copy (download it again; before an "
               "upload: snakemake --forcerun stage_and_push)")


def signature_name(bundle_dir: str | Path) -> str:
    return f"{Path(bundle_dir).name}{SUFFIX}"


def verify_command(bundle_rel: str) -> str:
    """What a user runs in a download of the Hub tree to check one bundle folder."""
    sig = f"{bundle_rel}/{signature_name(bundle_rel)}"
    return f"model_signing verify key {bundle_rel} --signature {sig} --public_key {PUBLIC_KEY}"


def key_from_env() -> tuple[Path | None, str]:
    """The private key's path from ``$RECURRENT_COREAI_SIGNING_KEY``, or None and why signing is skipped."""
    value = env.get(KEY_ENV, "").strip()
    if not value:
        return None, f"signing skipped: no {KEY_ENV} in the environment (bundles are published unsigned)"
    if not Path(value).is_file():
        raise PipelineError(f"${KEY_ENV}", "does not name a readable file",
                            f"point {KEY_ENV} at a PEM EC private key, or unset it to publish unsigned")
    return Path(value), f"signing with the key in ${KEY_ENV}"


def _password() -> bytes | None:
    value = env.get(PASSWORD_ENV)
    return value.encode() if value else None


def _private_key(private_key_pem: str | Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    fix = f"use a PEM EC private key on {', '.join(CURVES)} (see recurrent_coreai/hub/signing.py)"
    try:
        key = serialization.load_pem_private_key(Path(private_key_pem).read_bytes(), _password())
    except TypeError:  # encrypted without a password, or a password for a plain key
        raise PipelineError(KEY, "is encrypted and no password was given" if _password() is None
                            else "is not encrypted but a password was given",
                            f"set or unset {PASSWORD_ENV} to match the key") from None
    except ValueError:  # cryptography's text names neither the key nor its path
        raise PipelineError(KEY, "cannot be loaded (not a PEM private key, or a wrong password)", fix) from None
    except OSError as exc:
        raise PipelineError(KEY, f"cannot be read ({exc.strerror})",
                            f"check {KEY_ENV} and the file's permissions") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVES:
        raise PipelineError(KEY, "is not an elliptic-curve key on a curve model-signing supports", fix)
    return key


def public_key_pem(private_key_pem: str | Path) -> bytes:
    """The public half, as the PEM model-signing hashes into each signature's key id."""
    from cryptography.hazmat.primitives import serialization

    return _private_key(private_key_pem).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _public_key(public_key_pem: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_public_key(public_key_pem.read_bytes())
    except ValueError:
        key = None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise PipelineError(public_key_pem, "is not a PEM elliptic-curve public key",
                            f"verify with the {PUBLIC_KEY} published at the root of the same repository")


def fingerprint(public_pem: bytes) -> str:
    """sha256 of the public key PEM: ``sha256sum signing-key.pub``, and the ``hint`` in every signature."""
    return hashlib.sha256(public_pem).hexdigest()


def _ignored(bundle_dir: Path, signature_path: Path) -> list[Path]:
    """The signature itself, when it lives inside the folder it signs."""
    try:
        return [signature_path.resolve().relative_to(bundle_dir.resolve())]
    except ValueError:
        return []


def _hashing(bundle_dir: Path, signature_path: Path):
    from model_signing import hashing

    return hashing.Config().set_ignored_paths(paths=_ignored(bundle_dir, signature_path)).set_allow_symlinks(False)


def sign(bundle_dir: str | Path, private_key_pem: str | Path, signature_path: str | Path) -> None:
    """Sign every file of ``bundle_dir`` (but the signature) into ``signature_path``."""
    from model_signing import signing as ms_signing

    bundle_dir, signature_path = Path(bundle_dir), Path(signature_path)
    if not bundle_dir.is_dir():
        raise PipelineError(bundle_dir, "is not a bundle folder", "stage the bundle first")
    _private_key(private_key_pem)  # a bad key is one clear line, before model-signing sees it
    signature_path.unlink(missing_ok=True)
    try:
        ms_signing.Config().use_elliptic_key_signer(private_key=Path(private_key_pem), password=_password()) \
            .set_hashing_config(_hashing(bundle_dir, signature_path)).sign(bundle_dir, signature_path)
    except Exception as exc:  # noqa: BLE001 - model-signing raises assorted types; its text names no key
        raise PipelineError(bundle_dir, f"cannot be signed ({type(exc).__name__}: {_first_line(exc)})",
                            "check the folder holds only regular files (no symbolic links)") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def signed_files(signature_path: str | Path) -> dict[str, str]:
    """``{relative path: sha256}`` as listed in a model-signing signature (read, not verified)."""
    envelope = json.loads(Path(signature_path).read_text())["dsseEnvelope"]
    predicate = json.loads(base64.b64decode(envelope["payload"]))["predicate"]
    return {r["name"]: r["digest"] for r in predicate["resources"]}


def _changed_file(bundle_dir: Path, signature_path: Path) -> PipelineError | None:
    """Which file differs from what the signature lists, as a one-line error."""
    try:
        signed = signed_files(signature_path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    skip = {p.as_posix() for p in _ignored(bundle_dir, signature_path)}
    here = {rel.as_posix(): sha256_file(bundle_dir / rel) for rel in tree_files(bundle_dir)
            if rel.as_posix() not in skip}
    missing, added = set(signed) - set(here), set(here) - set(signed)
    # the folders of one model share their runner contract's names (runner.json, metadata.json,
    # tokenizer/): a signature of another bundle misses most of this folder and lists most of its own
    if signed and 2 * len(missing) > len(signed) and 2 * len(added) > len(here):
        return PipelineError(signature_path, f"lists none of the files of {bundle_dir}: it signs another bundle",
                             f"verify {bundle_dir} with its own {signature_name(bundle_dir)}")
    bad = first_difference({k: {"sha256": v} for k, v in here.items()}, {k: {"sha256": v} for k, v in signed.items()})
    if bad is None:
        return None
    what = ("is missing (it was signed)" if bad not in here else
            "was not signed (added after signing)" if bad not in signed else
            f"differs from the signed bundle (sha256 {here[bad][:12]}…, signed {signed[bad][:12]}…)")
    return PipelineError(bundle_dir / bad, what, CHANGED_FIX)


def verify(bundle_dir: str | Path, public_key_pem: str | Path, signature_path: str | Path) -> None:
    """Check ``bundle_dir`` against ``signature_path`` made by the key of ``public_key_pem``; a
    changed, missing or added file, a foreign key or a broken signature raises PipelineError."""
    from model_signing import verifying

    bundle_dir, signature_path, public_key_pem = Path(bundle_dir), Path(signature_path), Path(public_key_pem)
    for path, what in ((bundle_dir, "bundle folder"), (signature_path, "signature"), (public_key_pem, "public key")):
        if not path.exists():
            raise PipelineError(path, f"{what} not found", "download the whole bundle folder and signing-key.pub "
                                f"(or sign it: set {KEY_ENV} and stage again)")
    _public_key(public_key_pem)
    try:
        verifying.Config().use_elliptic_key_verifier(public_key=public_key_pem).set_hashing_config(
            _hashing(bundle_dir, signature_path)).verify(bundle_dir, signature_path)
    except Exception as exc:  # noqa: BLE001 - model-signing raises ValueError, KeyError, JSON and crypto errors
        text = _first_line(exc)
        detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        if text.startswith("Signature mismatch"):  # the signature is genuine; the files are not
            raise _changed_file(bundle_dir, signature_path) or PipelineError(
                bundle_dir, f"does not match its signature ({text})", CHANGED_FIX) from None
        if text.startswith("Key mismatch"):
            key = fingerprint(public_key_pem.read_bytes())[:16]
            raise PipelineError(signature_path, f"was not made by the key {public_key_pem.name} (sha256 {key}…)",
                                "verify with the signing-key.pub published with this bundle; "
                                "if that is the one, the signature was replaced: do not use this copy") from None
        raise PipelineError(signature_path, f"does not verify ({detail})",
                            "download the signature again; if it still fails, do not use this copy") from None


def sign_staged(staging_root: str | Path, bundle_rels: list[str]) -> dict:
    """Sign every bundle folder of a staged Hub tree with the key from the environment and put
    the public key at its root; returns the receipt's ``signing`` record (no key material)."""
    staging_root = Path(staging_root)
    key, reason = key_from_env()
    if key is None:
        return {"signed": False, "reason": reason}
    public = public_key_pem(key)
    (staging_root / PUBLIC_KEY).write_bytes(public)
    bundles = {}
    for rel in bundle_rels:
        folder = staging_root / rel
        sign(folder, key, folder / signature_name(folder))
        bundles[rel] = {"signature": f"{rel}/{signature_name(folder)}", "verify": verify_command(rel)}
    return {"signed": True, "reason": reason, "public_key": PUBLIC_KEY,
            "key_sha256": fingerprint(public), "bundles": bundles}


def verify_before_upload(staging_root: str | Path, record: dict) -> None:
    """Right before the commit: the staged public key is the receipt's, and every signed folder
    still verifies against it (a change after signing stops the upload, naming the file)."""
    if not record.get("signed"):
        return
    staging_root = Path(staging_root)
    public = staging_root / record["public_key"]
    if not public.is_file() or sha256_file(public) != record["key_sha256"]:
        raise PipelineError(public, "is not the public key the bundles were signed with (publish.json)",
                            "stage again (snakemake --forcerun stage_and_push); nothing was uploaded")
    for rel, entry in sorted(record["bundles"].items()):
        verify(staging_root / rel, public, staging_root / entry["signature"])
