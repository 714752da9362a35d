"""Prompt datasets: JSON lines and parquet files to `Prompt` records, in verl's or TRL's columns.

verl: `prompt` is a list of chat messages, `reward_model` is {"style", "ground_truth"}, and
`data_source` and `extra_info` (a dict) sit beside it. TRL: `prompt` is a plain string or a list of
messages, and any other column (e.g. `solution`) is handed to reward functions. Both load to the same
`Prompt`; every column other than prompt/reward_model/data_source/extra_info goes to `Prompt.columns`.
"""

import json
import os
from typing import Any

from tandem.errors import TandemError
from tandem.sample import Prompt

JSONL_EXTENSIONS = (".jsonl", ".json")
PARQUET_EXTENSIONS = (".parquet",)
VERL_COLUMNS = ("reward_model", "data_source", "extra_info")
GROUND_TRUTH_COLUMNS = ("ground_truth", "answer", "solution")  # tried in this order


def load_prompts(path: str, prompt_key: str = "prompt") -> list[Prompt]:
    """Read a .jsonl / .json (JSON lines, or one JSON array) or .parquet file into Prompts.

    ground_truth = reward_model["ground_truth"] if present, else the first of the top-level columns
    ground_truth, answer, solution. Raises TandemError naming the file (and row) on any bad input.
    """
    rows = _read_rows(path)
    if not rows:
        raise TandemError(f"Dataset {path} has no rows. Give a file with at least one prompt.")
    return [_to_prompt(row, where, path, prompt_key) for where, row in rows]


def prompts_from_rows(
    rows: list[dict[str, Any]], source: str = "rows", prompt_key: str = "prompt"
) -> list[Prompt]:
    """Rows already in memory (e.g. from a task generator) to Prompts, with the same checks as files."""
    return [_to_prompt(row, f"row {i}", source, prompt_key) for i, row in enumerate(rows)]


def save_rows(rows: list[dict[str, Any]], path: str) -> None:
    """Write rows as JSON lines (.jsonl / .json) or parquet (.parquet), chosen by the extension."""
    ext = _extension(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if ext in JSONL_EXTENSIONS:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise TandemError(
            f"Cannot write {path} as parquet: {e}. Parquet needs each column to have one type in every "
            "row; write .jsonl instead, or make the column types agree."
        ) from e
    pq.write_table(table, path)


def _extension(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in JSONL_EXTENSIONS + PARQUET_EXTENSIONS:
        raise TandemError(
            f"Dataset {path} has an unsupported extension {ext or '(none)'!r}. Supported: "
            f"{', '.join(JSONL_EXTENSIONS + PARQUET_EXTENSIONS)} (.json holds JSON lines or one JSON array)."
        )
    return ext


def _read_rows(path: str) -> list[tuple[str, dict[str, Any]]]:
    """[(where, row)] where `where` names the row in errors: "row 3 (line 5)" or "row 3"."""
    if os.path.isdir(path):
        raise TandemError(f"Dataset file {path} is a directory; name the .jsonl / .parquet files in it.")
    if not os.path.isfile(path):
        raise TandemError(f"Dataset file {path} does not exist (working directory: {os.getcwd()}).")
    ext = _extension(path)
    if ext in PARQUET_EXTENSIONS:
        return _read_parquet(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise TandemError(
            f"Dataset {path} is not UTF-8 text (byte {e.start}: {e.reason}); JSON lines must be UTF-8."
        ) from None
    except OSError as e:
        raise TandemError(f"Dataset file {path} cannot be read: {e.strerror or e}.") from None
    if ext == ".json" and text.lstrip().startswith("["):
        return _read_json_array(path, text)
    return _read_json_lines(path, text)


class _KeyTwice(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: an object, or _KeyTwice(key) where plain json keeps the last value."""
    obj = dict(pairs)
    if len(obj) < len(pairs):  # rare: only then look for which key it was
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _KeyTwice(key)
            seen.add(key)
    return obj


def _key_twice(path: str, where: str, e: _KeyTwice) -> TandemError:
    return TandemError(
        f"Dataset {path}: {where} has the key {e.args[0]!r} twice in one object; a JSON reader would keep "
        "the second value without a word. Keep one."
    )


def _read_json_lines(path: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    decode = json.JSONDecoder(object_pairs_hook=_unique_keys).decode
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"row {len(rows)} (line {line_number})"
        try:
            row = decode(line)
        except json.JSONDecodeError as e:
            raise TandemError(
                f"Dataset {path} has malformed JSON on line {line_number}: {e.msg} at column {e.colno}. "
                "Each line of a JSON-lines file must be one JSON object."
            ) from e
        except _KeyTwice as e:
            raise _key_twice(path, where, e) from None
        rows.append((where, _as_object(row, where, path)))
    return rows


def _read_json_array(path: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        items = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise TandemError(
            f"Dataset {path} has malformed JSON on line {e.lineno}: {e.msg} at column {e.colno}. A .json "
            "dataset is JSON lines (one object per line) or one JSON array of objects."
        ) from e
    except _KeyTwice as e:
        raise _key_twice(path, _array_row(text), e) from None
    return [(f"row {i}", _as_object(item, f"row {i}", path)) for i, item in enumerate(items)]


def _array_row(text: str) -> str:
    """The array's first row with a key twice, "row 3 (line 5)": decoded one row at a time, only
    once the whole-array read has found one (the hook cannot tell which row it is in)."""
    decoder = json.JSONDecoder(object_pairs_hook=_unique_keys)
    pos, row = text.index("[") + 1, 0
    while pos < len(text) and text[pos] != "]":
        if text[pos] in " \t\r\n,":
            pos += 1
            continue
        start = pos
        try:
            _, pos = decoder.raw_decode(text, pos)
        except _KeyTwice:
            return f"row {row} (line {text.count(chr(10), 0, start) + 1})"
        row += 1
    return "a row"


def _read_parquet(path: str) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise TandemError(f"Dataset {path} is not a readable parquet file: {e}.") from e
    # to_pylist, not pandas: nested columns come back as plain lists and dicts, as from JSON lines,
    # rather than numpy arrays of dicts.
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist(maps_as_pydicts="lossy"))]


def _as_object(row: Any, where: str, path: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise TandemError(
            f"Dataset {path}: {where} is a JSON {type(row).__name__}, not an object. Each row must be "
            'an object with a prompt column, e.g. {"prompt": [{"role": "user", "content": "..."}]}.'
        )
    return row


def _to_prompt(row: dict[str, Any], where: str, path: str, prompt_key: str) -> Prompt:
    raw = row.get(prompt_key)
    if raw is None or raw == "" or raw == []:
        problem = "has no" if prompt_key not in row else "has an empty"
        raise TandemError(
            f"Dataset {path}: {where} {problem} {prompt_key!r} column; its columns are "
            f"{', '.join(map(repr, row)) or 'none'}. Set data.prompt_key to the column that holds the "
            "prompt (a string, or a list of {role, content} messages), or fix the row."
        )
    messages, text = _parse_prompt(raw, where, path, prompt_key)
    reward_model = row.get("reward_model") if isinstance(row.get("reward_model"), dict) else {}
    ground_truth = reward_model.get("ground_truth")
    if ground_truth is None:
        ground_truth = next((row[k] for k in GROUND_TRUTH_COLUMNS if row.get(k) is not None), None)
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise TandemError(
            f"Dataset {path}: {where} has an extra_info of type {type(extra_info).__name__}; "
            "extra_info must be an object (a dict) when present."
        )
    return Prompt(
        messages=messages,
        text=text,
        ground_truth=ground_truth,
        data_source=str(row.get("data_source") or ""),
        extra_info=dict(extra_info or {}),
        columns={k: v for k, v in row.items() if k != prompt_key and k not in VERL_COLUMNS},
    )


def _parse_prompt(
    raw: Any, where: str, path: str, prompt_key: str
) -> tuple[list[dict[str, str]] | None, str | None]:
    """(messages, text): exactly one is set. Messages keep only role and content (parquet adds the
    union of all rows' keys, filled with None, so keeping more would make the two formats differ)."""
    if isinstance(raw, str):
        if not raw.strip():
            raise TandemError(f"Dataset {path}: {where} has an empty {prompt_key!r} (only whitespace).")
        return None, raw
    if isinstance(raw, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in raw
    ):
        return [{"role": m["role"], "content": m["content"]} for m in raw], None
    shown = json.dumps(raw, default=str)
    raise TandemError(
        f"Dataset {path}: {where} has a {prompt_key!r} that is neither a string nor a list of "
        f"{{role, content}} messages with string values: {shown[:200]}. Use a plain string (TRL) or "
        'a list like [{"role": "user", "content": "..."}] (verl, TRL conversational).'
    )
