"""The SGLang versions hisparse's HiCache backend and linker were tested against, and the check.

``hisparse.sglang`` reads SGLang host pools' buffers by layout
(``MLATokenToKVPoolHost.kv_buffer``), implements ``HiCacheStorage``'s v1/v2
calls and ``UnifiedCacheLinker``; all of these change between SGLang
releases without notice (the study counted three storage interfaces in a
year). An untested SGLang is refused when the backend is built, before it
can copy a single page with a wrong idea of the layout.
"""

from __future__ import annotations

TESTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)


class UnsupportedSglangVersion(RuntimeError):
    """The installed SGLang is not one hisparse's SGLang adapter was tested with."""


def installed_sglang_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))


def check_sglang_version(version: str | None = None) -> str:
    """Return the SGLang version, or raise ``UnsupportedSglangVersion`` naming the tested ones."""
    if version is None:
        version = installed_sglang_version()
    if version.split("+")[0] not in TESTED_SGLANG_VERSIONS:
        raise UnsupportedSglangVersion(
            f"hisparse's SGLang adapter (hisparse.sglang: the HiCache storage backend and the "
            f"unified-cache linker) supports SGLang {', '.join(TESTED_SGLANG_VERSIONS)} only; this "
            f"is SGLang {version}. Install a tested SGLang (pip install "
            f"'sglang=={TESTED_SGLANG_VERSIONS[-1]}', or pip install 'hisparse[sglang]') or run "
            "without --hicache-storage-backend dynamic / the hisparse linker")
    return version
