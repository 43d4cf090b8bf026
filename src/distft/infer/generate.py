"""Generating: decoding settings, one transcript, or a file of rows in any of the data formats.

Decoding is greedy by default (the same summary every time); `--temperature`, `--top-p` and
`--top-k` switch to sampling, seeded per row with `--seed`, so a row's output does not depend on
the rows before it. A row's prompt is its conversation up to its last assistant turn
(`distft.data.formats.prompt_and_reference`: a meeting's instruction + transcript, a chat's turns);
one longer than the run's `data.max_length` (minus the tokens kept free for the answer) is cut as
in training (earliest chat exchanges, then `data.truncation`), and the caller is told how many
tokens were dropped.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distft.config import DataConfig
from distft.data import ChatFormatter, Row, SummaryRow, prompt_and_reference
from distft.errors import ConfigError
from distft.infer.load import Loaded
from distft.io.files import atomic_text_file

PROMPT_ROOM = 32  # tokens at least of a prompt (the chat template alone takes 10-35)


@dataclass
class Sampling:
    """How tokens are chosen; greedy unless a sampling setting is given."""

    max_new_tokens: int = 128
    """Longest summary to generate, in tokens."""
    greedy: bool = True
    """Pick the most likely token at every step (deterministic)."""
    temperature: float = 1.0
    """Sampling: divide the logits by this (below 1 sharper, above 1 flatter)."""
    top_p: float = 1.0
    """Sampling: keep the smallest set of tokens whose probabilities sum to top_p (1: all)."""
    top_k: int = 0
    """Sampling: keep the k most likely tokens (0: all)."""
    repetition_penalty: float = 1.0
    """Divide the logits of tokens already generated or in the prompt by this (1: off)."""
    seed: int = 0
    """Seed of the sampling RNG, set before every row."""

    def check(self) -> None:
        """Refuse settings `generate` would reject or ignore, naming the flag."""
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"--max-new-tokens must be at least 1, got {self.max_new_tokens}: it is the longest summary "
                "to generate, in tokens (the default, 128, fits a meeting summary)."
            )
        # Written as what must hold, so NaN (false in every comparison) is refused too.
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(
                f"--temperature must be positive, got {self.temperature}; for deterministic output use --greedy."
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"--top-k cannot be negative, got {self.top_k} (0 keeps every token).")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(
                f"--repetition-penalty must be positive, got {self.repetition_penalty} (1: off)."
            )

    def check_room(self, max_length: int) -> None:
        """The answer leaves the prompt some of the run's context: `data.max_length` bounds both."""
        if self.max_new_tokens > max_length - PROMPT_ROOM:
            raise ConfigError(
                f"--max-new-tokens {self.max_new_tokens} leaves no room for the prompt: the run was trained "
                f"on data.max_length={max_length} tokens, prompt and answer together. Give at most "
                f"{max_length - PROMPT_ROOM}."
            )

    def generate_kwargs(self) -> dict:
        kwargs = {"do_sample": not self.greedy, "repetition_penalty": self.repetition_penalty}
        if not self.greedy:
            kwargs |= {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return kwargs


@dataclass
class Generated:
    """One generated answer (a summary, for a meeting) and what it took to make it."""

    summary: str
    prompt_tokens: int
    dropped_tokens: int  # prompt tokens cut to fit data.max_length (0: the whole prompt)


@torch.no_grad()
def generate(loaded: Loaded, source: str | Row, sampling: Sampling) -> Generated:
    """The answer to a row's prompt (its turns before the last assistant turn); a string is a
    meeting transcript to summarise."""
    row = SummaryRow(source, "", "prompt") if isinstance(source, str) else source
    formatter = ChatFormatter(loaded.tokenizer, loaded.cfg.data)
    messages, _ = prompt_and_reference(row, loaded.cfg.data)
    ids, dropped = formatter.generation_prompt(list(messages), reserve=sampling.max_new_tokens)
    prompt = torch.tensor([ids])
    torch.manual_seed(sampling.seed)  # per row: a row's sample does not depend on the rows before
    output = loaded.model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=sampling.max_new_tokens,
        use_cache=True,
        eos_token_id=formatter.end_id,
        pad_token_id=loaded.tokenizer.pad_token_id,
        **sampling.generate_kwargs(),
    )
    text = loaded.tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True).strip()
    return Generated(text, len(ids), dropped)


def truncation_notice(loaded: Loaded, row: Row, generated: Generated, sampling: Sampling) -> str | None:
    """One line saying how much of a row's prompt the model never saw, or None."""
    if not generated.dropped_tokens:
        return None
    data = loaded.cfg.data
    what, answer = ("transcript", "summary") if isinstance(row, SummaryRow) else ("prompt", "answer")
    return (
        f"notice: {row.origin}: the {what} was truncated, {generated.dropped_tokens} of its tokens dropped "
        f"(data.truncation={data.truncation}), to fit the run's data.max_length={data.max_length} with "
        f"{sampling.max_new_tokens} tokens kept free for the {answer}."
    )


@contextlib.contextmanager
def results_file(path: Path, cfg: DataConfig) -> Iterator[Callable[[Row, Generated], None]]:
    """A writer of `path` as JSON lines, one per input row as it is generated: where it came from,
    the generated text (`summary` for a meeting, `response` for the other formats), what was cut,
    and the row's own answer. The file appears whole, at the end (`atomic_text_file`)."""
    with atomic_text_file(path) as f:

        def write(row: Row, result: Generated) -> None:
            generated = asdict(result)
            text = "summary" if isinstance(row, SummaryRow) else "response"
            record = {"origin": row.origin, text: generated.pop("summary"), **generated}
            if reference := prompt_and_reference(row, cfg)[1]:
                record["reference"] = reference
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

        yield write
