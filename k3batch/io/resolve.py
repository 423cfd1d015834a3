"""Where a job's input is: resolve a user's input spec (a file, a directory, a glob; a local
path or any URI pyarrow.fs understands) to a fixed, sorted list of files of one format
(`resolve_input`); `io.source` streams them as units.

Formats (`FORMATS`; chosen by extension, or named): Parquet, JSON Lines and CSV, OpenAI batch
requests (JSON Lines named `format = "openai"`), Arrow IPC / Feather, and a Hugging Face
`save_to_disk` folder (its Arrow stream files, in the order its `state.json` lists them). A
directory or glob may not mix formats.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

# Glob magic in local paths. In URIs `?` starts a query string (s3://b/x?region=...), so there
# only `*` and `[` are glob characters.
_LOCAL_GLOB_CHARS = "*?["
_URI_GLOB_CHARS = "*["


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str  # as understood by the filesystem returned with it (normalized)
    uri: str  # what the user would recognise (original URI form); for messages and manifests
    size_bytes: int
    index: int  # position in the sorted list; the `f` of a unit
    format: str = "parquet"  # one of FORMATS except "auto"; how the file is read


# "auto": by extension. "hf": a Hugging Face save_to_disk folder (read as its Arrow files).
FORMATS = ("auto", "parquet", "jsonl", "csv", "arrow", "hf", "openai")
_EXTENSIONS = {  # longest suffix first where one ends another
    ".jsonl.gz": "jsonl",
    ".ndjson.gz": "jsonl",
    ".json.gz": "jsonl",
    ".csv.gz": "csv",
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",  # one object per line; a JSON array file is not read
    ".csv": "csv",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
_HF_STATE = "state.json"  # what marks a save_to_disk folder (with dataset_info.json)


def format_of(path: str) -> str | None:
    """The format a file's name says, or None: format_of("a/b.jsonl.gz") == "jsonl"."""
    name = path.lower()
    return next((fmt for ext, fmt in _EXTENSIONS.items() if name.endswith(ext)), None)


def _takes(fmt: str, path: str) -> bool:
    """Whether a listed file belongs to an input of format `fmt` ("auto": any known format)."""
    found = format_of(path)
    if fmt == "auto":
        return found is not None
    return found == ("jsonl" if fmt == "openai" else fmt)


def filesystem_from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, normalized path) for a local path (absolute or relative, no scheme) or any URI
    `pyarrow.fs.FileSystem.from_uri` understands. Raises ValueError naming `uri` if it cannot."""
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"expected a non-empty path or URI, got {uri!r}")
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # ArrowInvalid, OSError, ... depending on the scheme
        raise ValueError(f"cannot open {uri!r} as a filesystem URI: {e}") from e
    return fs, path


def _is_hidden(rel_path: str) -> bool:
    """True if any component of a relative path starts with '.' or '_' (_SUCCESS, .crc, ...)."""
    return any(part.startswith((".", "_")) for part in rel_path.split("/") if part)


def _split_glob(spec: str) -> tuple[str, str | None]:
    """Split `spec` into (base, pattern): base is the longest leading directory without glob
    characters; pattern is the rest, relative to base, or None if spec has no glob characters.
    A URI's query string stays on the base."""
    query = ""
    if "://" in spec:
        scheme, rest = spec.split("://", 1)
        head = scheme + "://"
        if "?" in rest:
            rest, query = rest.split("?", 1)
            query = "?" + query
        magic = _URI_GLOB_CHARS
    else:
        head, rest, magic = "", spec, _LOCAL_GLOB_CHARS
    first = min((i for i, c in enumerate(rest) if c in magic), default=None)
    if first is None:
        return spec, None
    slash = rest.rfind("/", 0, first)
    if head and slash < 0:
        # e.g. s3://bucket*/x: the glob would be in the bucket or host name.
        raise ValueError(f"glob characters in the bucket or host of {spec!r} are not supported")
    if slash < 0:
        base, pattern = ".", rest
    else:
        base, pattern = rest[:slash] or "/", rest[slash + 1 :]
    return head + base + query, pattern


def _glob_match(pattern_parts: list[str], path_parts: list[str]) -> bool:
    """Match path components against glob components; `**` matches zero or more components."""
    if not pattern_parts:
        return not path_parts
    head, rest = pattern_parts[0], pattern_parts[1:]
    if head == "**":
        return any(_glob_match(rest, path_parts[i:]) for i in range(len(path_parts) + 1))
    return (
        bool(path_parts)
        and fnmatch.fnmatchcase(path_parts[0], head)
        and _glob_match(rest, path_parts[1:])
    )


def _uri_prefix(base_uri: str, base_path: str) -> str:
    """The string to prepend to a filesystem path to get back the user's URI form."""
    if "://" not in base_uri:
        return ""
    uri = base_uri.split("?", 1)[0].rstrip("/")
    if uri.endswith(base_path.rstrip("/")):
        return uri[: len(uri) - len(base_path.rstrip("/"))]
    # Percent-encoding or other rewriting: fall back to scheme://netloc.
    scheme, rest = uri.split("://", 1)
    netloc = rest.split("/", 1)[0]
    return f"{scheme}://{netloc}" if base_path.startswith("/") else f"{scheme}://"


def resolve_input(spec: str, format: str = "auto") -> tuple[pafs.FileSystem, list[InputFile]]:
    """Resolve an input spec to (filesystem, files sorted by path, indexed 0..n-1), all of one
    format.

    spec: a file; a directory (every file of a known extension under it, recursively; a Hugging
    Face save_to_disk folder: its Arrow files); a glob (`data/*.jsonl`, `data/**/part-*.parquet`);
    each as a local path or any URI pyarrow.fs understands (file://, s3://, gs://, hdfs://, ...).
    format: one of FORMATS; "auto" decides by extension (a glob's files of no known extension
    are Parquet, as before formats existed). Files or directories whose name starts with '.' or
    '_' below the base (metadata such as _SUCCESS) are skipped. Raises ValueError naming `spec`
    if it does not exist, nothing matches, its formats are mixed or a file's format is unknown.
    """
    if format not in FORMATS:
        raise ValueError(f"input.format = {format!r} must be one of {', '.join(FORMATS)}")
    base_uri, pattern = _split_glob(spec)
    fs, base_path = filesystem_from_uri(base_uri)
    if len(base_path) > 1:
        base_path = base_path.rstrip("/")
    prefix = _uri_prefix(base_uri, base_path)

    single_file = False
    try:
        if pattern is None:
            info = fs.get_file_info(base_path)
            if info.type == pafs.FileType.File:
                infos, single_file = [info], True
            elif info.type == pafs.FileType.Directory:
                hf = _hf_files(fs, base_path, format)
                if hf is not None:
                    return fs, [
                        InputFile(path=i.path, uri=prefix + i.path, size_bytes=int(i.size),
                                  index=idx, format="arrow")  # fmt: skip
                        for idx, i in enumerate(hf)
                    ]
                selector = pafs.FileSelector(base_path, recursive=True)
                infos = [
                    i
                    for i in fs.get_file_info(selector)
                    if i.type == pafs.FileType.File and _takes(format, i.path)
                ]
            else:
                raise ValueError(f"input {spec!r} does not exist")
        else:
            parts = [p for p in pattern.split("/") if p]
            recursive = len(parts) > 1 or "**" in parts
            selector = pafs.FileSelector(base_path, recursive=recursive, allow_not_found=True)
            infos = [
                i
                for i in fs.get_file_info(selector)
                if i.type == pafs.FileType.File
                and _glob_match(parts, _relative(i.path, base_path).split("/"))
            ]
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"cannot list input {spec!r}: {e}") from e

    if not single_file:  # a file named explicitly is taken even if its name starts with '_'
        infos = [i for i in infos if not _is_hidden(_relative(i.path, base_path))]
    if not infos:
        what = "files" if format == "auto" else f"{format} files"
        raise ValueError(f"input {spec!r} matches no {what}")
    infos.sort(key=lambda i: i.path)
    formats = [_file_format(i.path, format, spec, named=single_file) for i in infos]
    kinds = sorted(set(formats))
    if len(kinds) > 1:
        counts = ", ".join(f"{formats.count(k)} {k}" for k in kinds)
        raise ValueError(
            f"input {spec!r} mixes formats ({counts} files): one job reads one format; "
            f"narrow input.path or set input.format"
        )
    files = [
        InputFile(path=i.path, uri=prefix + i.path, size_bytes=int(i.size), index=idx, format=fmt)
        for idx, (i, fmt) in enumerate(zip(infos, formats))
    ]
    return fs, files


def _file_format(path: str, format: str, spec: str, *, named: bool) -> str:
    if format == "hf":
        return "arrow"
    if format != "auto":
        return format
    found = format_of(path)
    if found is None and named:
        raise ValueError(
            f"input {spec!r}: cannot tell the format from the file name; set input.format "
            f"(one of {', '.join(FORMATS[1:])})"
        )
    return found or "parquet"


def _hf_files(fs: pafs.FileSystem, folder: str, format: str) -> list[pafs.FileInfo] | None:
    """The Arrow files of a Hugging Face save_to_disk folder in its own order, or None if
    `folder` is not one (no state.json). ValueError for a DatasetDict folder (pick a split)."""
    if format not in ("auto", "hf", "arrow"):
        return None
    state_path = f"{folder}/{_HF_STATE}"
    if fs.get_file_info(state_path).type != pafs.FileType.File:
        if format == "hf":
            dict_path = f"{folder}/dataset_dict.json"
            if fs.get_file_info(dict_path).type == pafs.FileType.File:
                raise ValueError(f"input {folder!r} holds several splits: name one split's folder")
            raise ValueError(f"input {folder!r} has no {_HF_STATE}: not a save_to_disk folder")
        return None
    with fs.open_input_stream(state_path) as src:
        try:
            state = json.loads(src.read())
            names = [d["filename"] for d in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"input {folder!r}: unreadable {_HF_STATE}: {e}") from e
    infos = fs.get_file_info([f"{folder}/{n}" for n in names])
    missing = [i.path for i in infos if i.type != pafs.FileType.File]
    if missing:
        raise ValueError(f"input {folder!r}: {_HF_STATE} lists missing files {missing[:3]}")
    return infos


def _relative(path: str, base: str) -> str:
    if base in ("", "/"):
        return path.lstrip("/")
    return path[len(base) :].lstrip("/") if path.startswith(base) else path
