"""Configuration: one frozen object, read once per communicator.

Every knob ubnext has is a field of :class:`Config`. Each field carries its
``UBNEXT_*`` environment variable, its default, a one-line description and the
parser that validates it, so the README table, the environment parsing and the
argument overrides all come from the same place. Nothing else in ubnext reads
``UBNEXT_*`` variables.

Example::

    cfg = Config.from_env(pool_mb=512)        # environment, then overrides
    print(Config.markdown_table())            # the README table

Print the table with
``python -c "from ubnext import Config; print(Config.markdown_table())"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["Config"]

_PREFIX = "UBNEXT_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: How the calls of a selector table entry were issued, of the modes ``python -m ubnext.tune
#: --mode`` measures and a communicator may ask for (``UBNEXT_TABLE_MODE``): back to back in
#: CUDA graphs, or each after a GEMM that writes its input.
TABLE_MODES = ("graph", "dependent")


class _Parser(NamedTuple):
    """A field parser: ``parse`` maps a raw value (a string from the
    environment, or a typed override) to the normalized value and raises
    ValueError or TypeError when it is invalid; ``expected`` describes the
    accepted values for the error message."""

    parse: Callable[[Any], Any]
    expected: str


def _int_at_least(minimum: int) -> _Parser:
    def parse(value: Any) -> int:
        if isinstance(value, str):
            value = int(value.strip(), 10)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(value)
        return value

    return _Parser(parse, f"an integer >= {minimum}")


def _parse_positive_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(value)
    number = float(value.strip() if isinstance(value, str) else value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(value)
    return number


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(value)


def _choice(*choices: str, upper: bool = False) -> _Parser:
    def parse(value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(value)
        text = str(value).strip()
        text = text.upper() if upper else text.lower()
        if text not in choices:
            raise ValueError(value)
        return text

    return _Parser(parse, "one of " + "|".join(choices))


def _parse_path(value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(value)
    return os.fspath(value).strip()


_POSITIVE_FLOAT = _Parser(_parse_positive_float, "a finite number > 0")
_BOOL = _Parser(_parse_bool, "one of " + "|".join(_TRUE + _FALSE))
_PATH = _Parser(_parse_path, "a file path, or empty")


def _field(env: str, default: Any, parser: _Parser, doc: str, local: str | None = None) -> Any:
    """Declare one config field with its metadata (env var, parser, doc).

    ``local``: why ranks may hold different values; None (the default) means the field
    shapes the pool layout, the grids, the selection or the protocol, so every rank of a
    communicator must hold the same value (``_agreement``).
    """
    return dataclasses.field(
        default=default, metadata={"env": env, "parser": parser, "doc": doc, "local": local}
    )


def _env_text(value: Any) -> str:
    """Spell a default the way a user would write it in the environment."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclasses.dataclass(frozen=True)
class Config:
    """Every ubnext setting, validated; immutable once created.

    Build it with :meth:`from_env` (environment plus per-communicator
    overrides). Constructing ``Config(...)`` directly also validates every
    field and normalizes it (e.g. ``algorithm="TwoShot"`` becomes
    ``"twoshot"``).

    Collective: no.
    Graph-capturable: yes (host only).

    Args:
        **fields: one keyword per field (the README's configuration table,
            ``Config.markdown_table()``); a field not given takes its default.

    Raises:
        ValueError: a field has an invalid value; the message names the field,
            its environment variable and the accepted values.
    """

    pool_mb: int = _field(
        "UBNEXT_POOL_MB", 1024, _int_at_least(1),
        "Symmetric memory pool size per rank, in MiB.",
    )
    staging_mb: int = _field(
        "UBNEXT_STAGING_MB", 128, _int_at_least(1),
        "Staging slot (MiB) for inputs that are not symmetric memory; larger "
        "messages are processed in chunks.",
    )
    lamport_max_kb: int = _field(
        "UBNEXT_LAMPORT_MAX_KB", 1024, _int_at_least(1),
        "Largest message (KiB) the Lamport one-shot kernel takes; sizes its "
        "receive buffers.",
    )
    lamport_twoshot_max_kb: int = _field(
        "UBNEXT_LAMPORT_TWOSHOT_MAX_KB", 16384, _int_at_least(1),
        "Largest message (KiB) the Lamport two-shot kernel takes in one launch (larger "
        "ones run in launches of this size; `auto` does so only from the default up); "
        "sizes its receive buffers (6x this per element width).",
    )
    algorithm: str = _field(
        "UBNEXT_ALGO", "auto", _choice("auto", "lamport", "lamport_twoshot", "twoshot", "nccl"),
        "All-reduce algorithm: `auto`, `lamport`, `lamport_twoshot`, `twoshot` or `nccl`.",
    )
    timeout_s: float = _field(
        "UBNEXT_TIMEOUT_S", 600.0, _POSITIVE_FLOAT,
        "Bound (seconds, > 0) on every device spin-wait: a peer that does not "
        "arrive in time breaks the communicator (an error on every rank, the CUDA "
        "context intact) instead of hanging it. The default, as torch.distributed's "
        "NCCL timeout, lets a live peer save a checkpoint or run an evaluation; it must "
        "also exceed a first call's kernel compilation (seconds, cached on disk).",
        local="how long this rank waits: a rank that gives up first breaks the communicator for all",
    )
    nvls: str = _field(
        "UBNEXT_NVLS", "auto", _choice("auto", "0", "1"),
        "NVLink multicast: `auto` (off until its kernels have run on hardware: "
        "opt-in), `0` (off), `1` (opt in: on where supported and allowed, else an "
        "error).",
    )
    max_blocks: int = _field(
        "UBNEXT_MAX_BLOCKS", 0, _int_at_least(0),
        "CTAs per kernel launch; `0` means one per SM.",
    )
    log_level: str = _field(
        "UBNEXT_LOG_LEVEL", "WARNING", _choice(*_LOG_LEVELS, upper=True),
        "Log level of the `ubnext` logger: `DEBUG`, `INFO`, `WARNING`, "
        "`ERROR` or `CRITICAL`.",
        local="this rank's logging only",
    )
    debug: bool = _field(
        "UBNEXT_DEBUG", False, _BOOL,
        "Ranks compare (size, dtype, op) before each launch and raise on a "
        "mismatch (costs a host round trip per call).",
    )
    deterministic: bool = _field(
        "UBNEXT_DETERMINISTIC", False, _BOOL,
        "Every ubnext kernel reduces in rank order and writes -0.0 as +0.0, so an "
        "all-reduce's bits depend on its inputs only, whatever algorithm `auto` takes; "
        "`auto` then uses neither NCCL nor NVLink multicast (whose orders are their own) "
        "where the kernels can run (integers, whose bits no order changes, stay with NCCL).",
    )
    tune_file: str = _field(
        "UBNEXT_TUNE_FILE", "", _PATH,
        "Selector table (JSON, format 2: machine entries of world size × dtype × size → algorithm; "
        "format 1 still read) written by `python -m ubnext.tune`; a communicator takes the entry for "
        "local rank 0's GPU (or the nearest measured); world sizes it lacks, and an empty value, use the "
        "shipped table (`ubnext/tables/default.json`).",
        local="the path may differ; the ranks check that the tables they read agree "
              "(ubnext._selection.table_format.agreed_table)",
    )
    table_mode: str = _field(
        "UBNEXT_TABLE_MODE", "graph", _choice(*TABLE_MODES),
        "The selector table entries `auto` takes, by how their calls were measured: `graph` (back to "
        "back in CUDA graphs) or `dependent` (each after a GEMM that writes its input, as in a model: "
        "`python -m ubnext.tune --mode dependent`). Where a table has no entry of that mode for the "
        "machine, one of another mode serves (the shipped table has a `dependent` entry for H100 only): "
        "`comm.describe()` says which entry.",
    )
    quantized: str = _field(
        "UBNEXT_QUANTIZED", "off", _choice("off", "int8", "fp8", "int4"),
        "Opt in to the quantized two-shot all-reduce and reduce-scatter (lossy, with a stated error "
        "bound: docs/quantized.md): `off`, `int8`, `fp8` (e4m3, sm_89+) or `int4` "
        "(fewer bytes than int8, a larger error bound). When set, "
        "`auto` reduces bfloat16/float16 sums and averages in that format from the size "
        "`python -m ubnext.tune` measured for the machine, world size and collective (the selector "
        "table's quantized thresholds; where none was measured, or it never pays, never: "
        "`comm.describe()` says which), and "
        "`precision=` can pick any format per call; it reserves the receive areas in "
        "the pool (18 + 18/N MiB per rank: 22.5 MiB at 4 ranks).",
    )
    pdl: bool = _field(
        "UBNEXT_PDL", True, _BOOL,
        "Programmatic dependent launch (sm_90+): each ubnext kernel may start while the kernel "
        "before it on the stream ends, its launch and set-up hidden under that kernel's tail, "
        "and waits inside for that kernel's results; `0` starts each after the one before has "
        "completed.",
        local="this rank's launches only",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(
                self, f.name, _parse_field(f, getattr(self, f.name), f.name)
            )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> Config:
        """Read the ``UBNEXT_*`` variables, then apply per-call overrides.

        Collective: no.
        Graph-capturable: yes (host only).

        Args:
            environ: where to read variables from; ``os.environ`` when None.
            **overrides: field values that win over the environment (e.g.
                ``pool_mb=512``). A value of None means "not overridden", so a
                constructor can forward its optional keyword arguments as-is.

        Returns:
            The validated, frozen configuration.

        Raises:
            TypeError: an override names no field.
            ValueError: a value is invalid; the message names the variable (or
                argument) and the accepted values.

        Warns:
            UserWarning: once per call, if ``environ`` holds ``UBNEXT_*``
                variables that are not known (with the closest known names).
        """
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown_args = sorted(set(overrides) - set(fields))
        if unknown_args:
            raise TypeError(
                f"Config.from_env: unknown argument(s) {', '.join(unknown_args)}; "
                f"known: {', '.join(fields)}"
            )
        _warn_unknown(environ, [f.metadata["env"] for f in fields.values()])

        values: dict[str, Any] = {}
        for name, f in fields.items():
            env = f.metadata["env"]
            if overrides.get(name) is not None:
                values[name] = _parse_field(f, overrides[name], f"argument {name}")
            elif env in environ:
                values[name] = _parse_field(f, environ[env], env)
        return cls(**values)

    @classmethod
    def markdown_table(cls) -> str:
        """Render the README configuration table from the field metadata.

        Collective: no.
        Graph-capturable: yes (host only).

        Returns:
            A Markdown table (variable | default | meaning), one row per
            field, ending with a newline.

        Raises:
            Nothing.
        """
        rows = ["| variable | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = _env_text(f.default)
            shown = f"`{default}`" if default else "(empty)"
            rows.append(f"| `{f.metadata['env']}` | {shown} | {f.metadata['doc']} |")
        return "\n".join(rows) + "\n"


def _parse_field(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Parse one value for field ``f``; ``source`` names where it came from."""
    parser = f.metadata["parser"]
    try:
        return parser.parse(value)
    except (ValueError, TypeError):
        env = f.metadata["env"]
        where = source if source == env else f"{source} ({env})"
        raise ValueError(
            f"Config: invalid {where}={value!r}; expected {parser.expected}"
        ) from None


def _warn_unknown(environ: Mapping[str, str], known: list[str]) -> None:
    """Emit one UserWarning listing unknown ``UBNEXT_*`` variables, if any."""
    unknown = sorted(k for k in environ if k.startswith(_PREFIX) and k not in known)
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    warnings.warn(
        f"Config.from_env: unknown environment variable(s) {', '.join(parts)}; "
        f"they are ignored. Known: {', '.join(known)}",
        UserWarning,
        stacklevel=3,
    )
