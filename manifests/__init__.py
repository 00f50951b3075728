"""Content-addressed artifacts: chunking, the manifest model and codec, scan, plan, materialise.

Pure library (no trio, no network). Public API:

- chunking: ``ChunkerParams``, ``ChunkRef``, ``chunk_file``, ``chunk_buffer``
- model: ``Manifest`` (``.id``, ``.entries``, ``.chunks``), ``Entry``, ``Chunk``, ``ManifestBuilder``,
  ``validate_manifest``, limits (``MAX_*``), ``MANIFEST_VERSION``
- codec: ``encode_manifest``, ``decode_manifest``, ``manifest_id``, ``to_json_view``
- scan: ``scan_tree`` -> ``ScanResult(.manifest, .sources)``, ``ChunkSource``
- errors: ``ManifestError``, ``IntegrityError``, ``ChunkerUnavailable``, ``ChunkMissing``
"""

from .chunking import ChunkRef, check_chunker, chunk_buffer, chunk_file
from .codec import decode_manifest, encode_manifest, manifest_id, to_json_view
from .errors import ChunkerUnavailable, ChunkMissing, IntegrityError, ManifestError
from .model import (
    MANIFEST_VERSION,
    MAX_CHUNKS,
    MAX_ENTRIES,
    MAX_MANIFEST_BYTES,
    MAX_PATH_BYTES,
    Chunk,
    ChunkerParams,
    Entry,
    Manifest,
    ManifestBuilder,
    validate_manifest,
)
from .scan import ChunkSource, ScanResult, scan_tree

__all__ = [
    "MANIFEST_VERSION",
    "MAX_CHUNKS",
    "MAX_ENTRIES",
    "MAX_MANIFEST_BYTES",
    "MAX_PATH_BYTES",
    "Chunk",
    "ChunkMissing",
    "ChunkRef",
    "ChunkSource",
    "ChunkerParams",
    "ChunkerUnavailable",
    "Entry",
    "IntegrityError",
    "Manifest",
    "ManifestBuilder",
    "ManifestError",
    "ScanResult",
    "check_chunker",
    "chunk_buffer",
    "chunk_file",
    "decode_manifest",
    "encode_manifest",
    "manifest_id",
    "scan_tree",
    "to_json_view",
    "validate_manifest",
]
