"""Find the simple commands of a shell script, with the character offsets of their words.

The rewrite edits the original string by offsets, so quoting survives byte for
byte. ``bashlex`` gives the structure (lists, pipelines, compound commands,
heredocs); where it cannot parse a piece (quoted heredoc delimiters, ``[[``,
``case``), that line is tokenized with ``shlex`` (punctuation_chars) instead.
"""
from __future__ import annotations

import io
import shlex
from dataclasses import dataclass, field

import bashlex

# a chunk that bashlex calls unfinished may end a few lines later
_MAX_CHUNK_LINES = 64
# words that open a compound statement; they are not the command's program
_RESERVED = {"if", "then", "elif", "else", "fi", "do", "done", "while", "until", "for",
             "!", "{", "}", "time", "case", "esac", "in", "function"}
_SEPARATORS = {"&&", "||", ";", "|", "&", "|&", ";;", ";&", ";;&", "(", ")", "\n"}


@dataclass(frozen=True)
class Word:
    value: str  # with quotes removed (as far as the tokenizer does it)
    start: int  # offsets into the whole script
    end: int


@dataclass
class Command:
    """One simple command: assignments, then words (redirections dropped)."""

    assignments: list[Word]
    words: list[Word]
    statement_start: int  # start of the top-level statement holding it
    parser: str  # "bashlex" or "shlex"


@dataclass
class Parsed:
    commands: list[Command] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parse_script(script: str) -> Parsed:
    """All simple commands of ``script`` in source order."""
    out = Parsed()
    if _blank(script):
        return out
    try:
        _walk_bashlex(bashlex.parse(script), 0, out, None)
        return out
    except Exception:  # noqa: BLE001 - bashlex raises many kinds; go line by line
        out.commands.clear()
    _parse_by_lines(script, out)
    out.commands.sort(key=lambda c: c.words[0].start if c.words else c.statement_start)
    return out


def _blank(text: str) -> bool:
    return all(not ln.strip() or ln.strip().startswith("#") for ln in text.splitlines())


def _parse_by_lines(script: str, out: Parsed) -> None:
    lines = script.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    i = 0
    while i < len(lines):
        if _blank(lines[i]):
            i += 1
            continue
        nxt = _try_bashlex_chunk(lines, starts, i, out)
        if nxt is None:
            nxt = _shlex_line(lines, starts, i, out)
        i = nxt


def _try_bashlex_chunk(lines: list[str], starts: list[int], i: int, out: Parsed) -> int | None:
    """Parse lines[i:j] with bashlex for the smallest j that works; the next line index."""
    for j in range(i + 1, min(len(lines), i + _MAX_CHUNK_LINES) + 1):
        chunk = "".join(lines[i:j])
        try:
            nodes = bashlex.parse(chunk)
        except bashlex.errors.ParsingError as exc:
            # only an unfinished construct can be completed by more lines
            if "unexpected EOF" in str(exc) or "matching" in str(exc):
                continue
            return None
        except Exception:  # noqa: BLE001 - NotImplementedError for case etc.
            return None
        found = Parsed()
        try:
            _walk_bashlex(nodes, starts[i], found, None)
        except Exception:  # noqa: BLE001 - odd node shapes: let shlex try
            return None
        out.commands.extend(found.commands)
        return j
    return None


def _walk_bashlex(nodes, base: int, out: Parsed, statement_start: int | None) -> None:
    for node in nodes if isinstance(nodes, list) else [nodes]:
        if not hasattr(node, "kind"):
            continue
        top = statement_start if statement_start is not None else base + node.pos[0]
        if node.kind == "command":
            assigns, words = [], []
            for part in node.parts:
                if part.kind == "assignment" and not words:
                    assigns.append(Word(part.word, base + part.pos[0], base + part.pos[1]))
                elif part.kind == "word":
                    words.append(Word(part.word, base + part.pos[0], base + part.pos[1]))
                    _walk_children(part, base, out, top)
                elif part.kind == "redirect":
                    target = getattr(part, "output", None)
                    if target is not None and getattr(target, "kind", "") == "word":
                        _walk_children(target, base, out, top)
            while words and words[0].value in _RESERVED:
                words.pop(0)
            if words or assigns:
                out.commands.append(Command(assigns, words, top, "bashlex"))
        else:
            _walk_children(node, base, out, top)


def _walk_children(node, base: int, out: Parsed, top: int) -> None:
    # compound nodes keep children in .parts or .list; substitutions in .command
    for attr in ("parts", "list"):
        kids = getattr(node, attr, None)
        if isinstance(kids, list):
            _walk_bashlex(kids, base, out, top)
    sub = getattr(node, "command", None)
    if sub is not None and hasattr(sub, "kind"):
        _walk_bashlex([sub], base, out, top)


def _shlex_tokens(text: str) -> list[Word]:
    """shlex tokens of ``text`` with offsets, read off the lexer's stream position."""
    stream = io.StringIO(text)
    lex = shlex.shlex(stream, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    tokens: list[Word] = []
    while True:
        # shlex gives no positions: the stream offset, less what it read ahead
        before = stream.tell() - len(lex._pushback_chars)
        tok = lex.get_token()
        if tok is None or tok == lex.eof:
            break
        after = stream.tell() - len(lex._pushback_chars)
        start = _skip_blank(text, before)
        end = after
        # the whitespace that ended a word was consumed with it
        while end > start + 1 and text[end - 1] in " \t\r\n" and text[end - 2] != "\\":
            end -= 1
        tokens.append(Word(tok, start, end))
    return tokens


def _skip_blank(text: str, pos: int) -> int:
    while pos < len(text):
        if text[pos] in " \t\r\n":
            pos += 1
        elif text[pos] == "#":
            nl = text.find("\n", pos)
            pos = len(text) if nl < 0 else nl + 1
        else:
            break
    return pos


def _shlex_line(lines: list[str], starts: list[int], i: int, out: Parsed) -> int:
    """Fallback for line i; skips the bodies of heredocs it opens. Next line index."""
    text = lines[i]
    try:
        tokens = _shlex_tokens(text)
    except ValueError as exc:  # unbalanced quotes: nothing to edit safely here
        out.notes.append(f"line {i + 1}: cannot tokenize ({exc})")
        return i + 1
    base = starts[i]
    stmt = base + _skip_blank(text, 0)
    heredocs: list[tuple[str, bool]] = []
    current: list[Word] = []
    assigns: list[Word] = []
    skip_next = False
    for k, tok in enumerate(tokens):
        is_punct = bool(tok.value) and all(ch in "();<>|&" for ch in tok.value)
        if skip_next:
            skip_next = False
            continue
        if is_punct and ("<" in tok.value or ">" in tok.value):
            # redirection: drop the operator, its target and an adjacent fd number
            if current and current[-1].value.isdigit() and current[-1].end == base + tok.start:
                current.pop()
            if tok.value.startswith("<<") and not tok.value.startswith("<<<") and k + 1 < len(tokens):
                delim = tokens[k + 1].value
                strip_tabs = delim.startswith("-") and tokens[k + 1].start == tok.end
                heredocs.append((delim[1:] if strip_tabs else delim, strip_tabs))
            skip_next = True
            continue
        if is_punct and tok.value in _SEPARATORS or tok.value in _SEPARATORS:
            _flush(out, assigns, current, stmt)
            assigns, current = [], []
            continue
        word = Word(tok.value, base + tok.start, base + tok.end)
        if not current and "=" in tok.value and tok.value.split("=", 1)[0].isidentifier():
            assigns.append(word)
        else:
            current.append(word)
    _flush(out, assigns, current, stmt)
    nxt = i + 1
    for delim, strip_tabs in heredocs:
        while nxt < len(lines):
            body = lines[nxt].rstrip("\r\n")
            nxt += 1
            if (body.lstrip("\t") if strip_tabs else body) == delim:
                break
    return nxt


def _flush(out: Parsed, assigns: list[Word], words: list[Word], stmt: int) -> None:
    words = list(words)
    while words and words[0].value in _RESERVED:
        words.pop(0)
    if words and words[0].value == "[[":  # a test expression, not a program
        return
    if words or assigns:
        out.commands.append(Command(list(assigns), words, stmt, "shlex"))
