r"""The math reward: last `\boxed{}` answer of a completion, graded against the gold with math-verify.

- The prediction is the content of the *last* `\boxed{...}` (or `\fbox{...}`) in the completion; no box scores 0.
- Golds are bare LaTeX (e.g. `\frac{1}{3}`); they are wrapped as `$...$` so math-verify parses them (about 160
  of the 1,460 Sanity golds fail to parse otherwise).
- math-verify times out with `signal.alarm`, which only works on the main thread: off the main thread the
  timeouts are passed as `None` (no alarm).
- Plain integers on both sides are compared directly (fast path for the tiny arithmetic task: no sympy).
- Never raises: anything malformed scores 0.0.
"""

from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INT_RE = re.compile(r"^[+-]?\d+$")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(,\d{3})+$")  # 30,951 (a list of answers, "1,3", is not an integer)


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` with balanced braces, or None (also for an unclosed box)."""
    if not isinstance(text, str):
        return None
    for start in reversed([m.end() for m in _BOX_RE.finditer(text)]):
        depth, i = 1, start
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
            i += 1
    return None


def wrap_latex(s: str) -> str:
    """Wrap bare LaTeX as `$...$` unless already delimited."""
    s = s.strip()
    return s if s.startswith(("$", "\\(", "\\[")) else f"${s}$"


@lru_cache(maxsize=65536)
def _parse_cached(latex: str, main_thread: bool):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(latex, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=10 if main_thread else None)


def _int_or_none(s: str) -> int | None:
    """The integer `s` spells (plain, or with thousands separators), else None: the fast path of `grade`."""
    s = s.strip().replace(" ", "")
    s = s[1:-1] if len(s) > 1 and s[0] == "$" and s[-1] == "$" else s
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return int(s) if _INT_RE.match(s) else None


def grade(pred: str | None, gold: str) -> float:
    """1.0 if the boxed prediction `pred` equals `gold` (bare LaTeX), else 0.0. Never raises."""
    try:
        if pred is None or not isinstance(gold, str) or not pred.strip():
            return 0.0
        gi, pi = _int_or_none(gold), _int_or_none(pred)
        if gi is not None and pi is not None:
            return float(gi == pi)
        from math_verify import verify

        main = threading.current_thread() is threading.main_thread()
        if not main:  # no timeouts there, and math-verify logs an error for each
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).setLevel(logging.ERROR)
        gold_parsed = _parse_cached(wrap_latex(gold), main)
        pred_parsed = _parse_cached(wrap_latex(pred), main)
        if not gold_parsed or not pred_parsed:
            return 0.0
        return float(verify(gold_parsed, pred_parsed, timeout_seconds=5 if main else None))
    except Exception:  # noqa: BLE001 - a reward must never crash a training step
        return 0.0


def completion_text(completion) -> str:
    """A TRL completion (plain string or a list of chat messages) as text."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return ""


def math_reward(completions, answer, **kwargs) -> list[float]:
    r"""TRL reward function: `answer` is the dataset column with the golds."""
    return [grade(last_boxed(completion_text(c)), str(a)) for c, a in zip(completions, answer, strict=True)]

