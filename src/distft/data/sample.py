"""Synthetic meeting transcripts with reference summaries, bundled for offline runs and CI.

The AMI corpus is the real workload, but it needs a download (and `knkarthick/AMI` is gated).
These meetings stand in for it: a deterministic generator (standard library only, seeded
`random.Random`) writes AMI-style transcripts, one `Name: text` turn per line as in the
`dialogue` field of knkarthick/AMI, with speakers and roles, an agenda, discussion with numbers,
objections and agreement, spoken disfluencies, decisions and action items. The summary is written
from the same facts, so a model can learn the mapping from transcript to summary.

`SAMPLES` names the synthetic sets `data.source` may be: `sample`, these meetings (a few hundred
tokens, 0.9 MB), bundled in the package; `sample-pairs`, the same meetings as preference rows (the
true summary chosen, one with a detail the meeting never had rejected: `train.objective=dpo`); and `sample-long`, whole meetings of 4.7k-28k tokens
(`distft.data.sample_long`): 3.9 MB for 72 rows, four times the bundle and a pure function of the
code, so it is not shipped but written in half a second on first use into distft's cache
(`$DISTFT_CACHE`, else ~/.cache/distft; an installed package's directory may be read-only), under
a hash of the generators' code: a changed generator writes a new set, never reads a stale one.

Regenerate the bundled files with `python -m distft.data.sample` (byte-identical on every machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distft.data import sample_long
from distft.data.sample_long import DAYS, NAMES  # the people and days both generators draw from
from distft.data.sample_pairs import ERRORS, with_unsaid_detail
from distft.data.tokenizer import cache_root
from distft.errors import DataError

SAMPLE_DIR = Path(__file__).parent / "sample"
SAMPLE_SPLITS: dict[str, tuple[int, int]] = {"train": (400, 1234), "validation": (40, 98765)}
LONG_SPLITS: dict[str, tuple[int, int]] = {"train": (64, 4321), "validation": (8, 56789)}

FILLERS = ["um", "uh", "yeah", "okay", "mm-hmm", "right", "so", "well"]

# Each domain: purpose, roles, and agenda items; an item offers options and a unit for its value.
DOMAINS: list[dict] = [
    {
        "purpose": "design a new television remote control",
        "roles": ["project manager", "marketing expert", "user interface designer", "industrial designer"],
        "items": [
            ("the selling price", ["20", "25", "30", "35"], "euros"),
            ("the case colour", ["yellow", "dark grey", "light blue", "red"], ""),
            (
                "the battery type",
                ["a kinetic battery", "two AA batteries", "a solar cell", "a rechargeable pack"],
                "",
            ),
            ("the number of buttons", ["eight", "ten", "twelve", "fifteen"], "buttons"),
            ("the case material", ["rubber", "plastic", "wood", "titanium"], ""),
        ],
    },
    {
        "purpose": "plan the redesign of the company website",
        "roles": ["product owner", "web developer", "designer", "content lead"],
        "items": [
            ("the launch date", ["March 3", "April 14", "May 1", "June 20"], ""),
            ("the content system", ["WordPress", "a static site generator", "Drupal", "a headless CMS"], ""),
            ("the budget", ["12000", "18000", "25000", "30000"], "euros"),
            (
                "the home page layout",
                ["a single long page", "a card grid", "a video banner", "a search-first page"],
                "",
            ),
        ],
    },
    {
        "purpose": "agree on the department budget for next year",
        "roles": ["finance manager", "team lead", "operations manager", "analyst"],
        "items": [
            ("the travel budget", ["5", "8", "10", "15"], "percent lower"),
            ("the hiring budget", ["two", "three", "four", "five"], "new positions"),
            ("the software spending", ["40000", "55000", "60000", "75000"], "euros"),
            ("the training allowance", ["500", "800", "1000", "1500"], "euros per person"),
        ],
    },
    {
        "purpose": "organise the annual customer conference",
        "roles": ["event coordinator", "marketing expert", "sales lead", "logistics manager"],
        "items": [
            (
                "the venue",
                ["the city hall", "a hotel by the lake", "the university campus", "the old harbour hall"],
                "",
            ),
            ("the number of guests", ["150", "200", "300", "400"], "guests"),
            ("the ticket price", ["90", "120", "150", "200"], "euros"),
            (
                "the keynote speaker",
                ["an industry analyst", "the chief executive", "a customer", "a professor"],
                "",
            ),
        ],
    },
    {
        "purpose": "prepare the next software release",
        "roles": ["engineering manager", "backend developer", "tester", "release manager"],
        "items": [
            ("the release date", ["the 5th", "the 12th", "the 19th", "the 26th"], "of next month"),
            ("the test coverage target", ["70", "75", "80", "85"], "percent"),
            (
                "the feature to postpone",
                ["offline mode", "dark theme", "the export wizard", "team sharing"],
                "",
            ),
            (
                "the rollout",
                ["a staged rollout", "a full rollout", "a beta group first", "one region first"],
                "",
            ),
        ],
    },
    {
        "purpose": "decide how to fill the open support engineer position",
        "roles": ["hiring manager", "recruiter", "support lead", "team member"],
        "items": [
            ("the salary range", ["45000", "50000", "55000", "60000"], "euros"),
            ("the interview rounds", ["two", "three", "four", "five"], "rounds"),
            (
                "the job posting",
                ["the company site", "a jobs board", "a recruiting agency", "university fairs"],
                "",
            ),
            ("the start date", ["January", "February", "March", "April"], ""),
        ],
    },
]

OPENERS = [
    "Okay, let's get started. Today we need to {purpose}.",
    "Right, thanks everyone for coming. The goal of this meeting is to {purpose}.",
    "So, um, welcome. We are here to {purpose}.",
]
PROPOSALS = [
    "I would suggest {option} for {item}.",
    "What about {option}? I think that works for {item}.",
    "From my side, {option} makes the most sense for {item}.",
    "Our research points to {option} for {item}.",
]
OBJECTIONS = [
    "I'm not sure about {option}, it might be too expensive.",
    "Hmm, {option} could be hard to explain to the users.",
    "{option} sounds risky to me, to be honest.",
    "Last time we tried {option} it took longer than planned.",
]
SUPPORT = [
    "I agree, {option} is a good choice.",
    "Yeah, {option} fits what the customers told us.",
    "Fine with me, let's go with {option}.",
    "That makes sense, {option} it is.",
]
SMALL_TALK = [
    "Can everyone see the slides?",
    "Sorry, my microphone was muted.",
    "Let me just write that down.",
    "Should we take a short break after this?",
    "I'll send the notes around later.",
    "That reminds me of the last project, actually.",
]


def _value(option: str, unit: str) -> str:
    return f"{option} {unit}".strip()


def _speak(rng: random.Random, text: str) -> str:
    """Spoken style: an occasional filler word at the start of a turn."""
    if rng.random() < 0.3:
        keep_case = text.startswith(("I ", "I'"))
        text = f"{rng.choice(FILLERS).capitalize()}, {text if keep_case else text[0].lower() + text[1:]}"
    return text


def generate_meeting(rng: random.Random, meeting_id: str) -> dict[str, str]:
    """One meeting: {"id", "transcript", "summary"}."""
    domain = rng.choice(DOMAINS)
    n_speakers = rng.randint(3, 4)
    names = rng.sample(NAMES, n_speakers)
    roles = dict(zip(names, domain["roles"][:n_speakers], strict=True))
    chair = names[0]
    items = rng.sample(domain["items"], rng.randint(2, 3))
    long_meeting = rng.random() < 0.1  # ~10% long meetings exercise the truncation policy
    rounds = rng.randint(5, 8) if long_meeting else 1

    lines: list[str] = [f"{chair}: {rng.choice(OPENERS).format(purpose=domain['purpose'])}"]
    lines.append(
        f"{chair}: " + " ".join(f"I'm {n}, the {r}." if n == chair else "" for n, r in roles.items()).strip()
    )
    for name in names[1:]:
        lines.append(f"{name}: {_speak(rng, f'Hi, I am {name}, {roles[name]}.')}")
    agenda = ", ".join(item for item, _, _ in items)
    lines.append(f"{chair}: The agenda today is {agenda}, and then the action items.")

    decisions: list[tuple[str, str]] = []
    for item, options, unit in items:
        lines.append(f"{chair}: {_speak(rng, f'Let us talk about {item}.')}")
        first, chosen = rng.sample(options, 2)
        for _ in range(rounds):
            a, b = rng.sample(names, 2)
            lines.append(
                f"{a}: {_speak(rng, rng.choice(PROPOSALS).format(option=_value(first, unit), item=item))}"
            )
            lines.append(f"{b}: {_speak(rng, rng.choice(OBJECTIONS).format(option=_value(first, unit)))}")
            if rng.random() < 0.4:
                lines.append(f"{rng.choice(names)}: {rng.choice(SMALL_TALK)}")
        c, d = rng.sample(names, 2)
        lines.append(
            f"{c}: {_speak(rng, rng.choice(PROPOSALS).format(option=_value(chosen, unit), item=item))}"
        )
        lines.append(f"{d}: {_speak(rng, rng.choice(SUPPORT).format(option=_value(chosen, unit)))}")
        lines.append(f"{chair}: So we decide on {_value(chosen, unit)} for {item}.")
        decisions.append((item, _value(chosen, unit)))

    tasks = ["prepare the detailed proposal", "check the costs with finance", "draft the presentation",
             "contact the suppliers", "update the project plan", "collect feedback from users"]  # fmt: skip
    owners = rng.sample(names, 2)
    actions = [
        (owner, task, rng.choice(DAYS)) for owner, task in zip(owners, rng.sample(tasks, 2), strict=True)
    ]
    lines.append(f"{chair}: Okay, action items.")
    for owner, task, day in actions:
        lines.append(f"{owner}: {_speak(rng, f'I will {task} by {day}.')}")
    lines.append(f"{chair}: Great, thanks everyone. See you next time.")

    agreed = [f"{value} for {item}" for item, value in decisions]
    decided = ", ".join(agreed[:-1]) + f" and {agreed[-1]}"
    todo = " ".join(f"{owner} will {task} by {day}." for owner, task, day in actions)
    summary = f"The team met to {domain['purpose']}. After some discussion they agreed on {decided}. {todo}"
    return {"id": meeting_id, "transcript": "\n".join(lines), "summary": summary}


def generate_meeting_pairs(rng: random.Random, meeting_id: str) -> list[dict[str, str]]:
    """A meeting as three preference rows, a wrong day, decision and owner
    (`distft.data.sample_pairs.with_unsaid_detail`): the same meetings as `sample`, drawn from the
    same seeds. All three, so that what a model learns is to check the meeting, not which detail
    of a summary tends to be wrong."""
    meeting = generate_meeting(rng, meeting_id)
    return [with_unsaid_detail(meeting, DOMAINS, error) for error in ERRORS]


# ---- the synthetic sets `data.source` may name --------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """A synthetic set: what it is called in lineage and model cards, its splits as (meetings, seed),
    the generator of one meeting's rows, and whether its files ship in the package (else: the cache)."""

    title: str
    splits: dict[str, tuple[int, int]]
    rows: Callable[[random.Random, str], list[dict[str, str]]]
    bundled: bool


SAMPLES: dict[str, Sample] = {
    "sample": Sample(
        "the bundled synthetic meetings", SAMPLE_SPLITS, lambda rng, id_: [generate_meeting(rng, id_)], True
    ),
    "sample-pairs": Sample(
        "the bundled meetings as preference pairs (a detail the meeting never had, rejected)",
        SAMPLE_SPLITS,
        generate_meeting_pairs,
        False,
    ),
    "sample-long": Sample(
        "the long synthetic meetings of 4.7k-28k tokens",
        LONG_SPLITS,
        lambda rng, id_: [sample_long.generate_long_meeting(rng, id_)],
        False,
    ),
}


def is_sample(source: str) -> bool:
    """Whether `data.source` names one of distft's synthetic sets (`SAMPLES`)."""
    return source in SAMPLES


def generate_split(split: str, n: int, seed: int, name: str = "sample") -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [row for i in range(n) for row in SAMPLES[name].rows(rng, f"{name}-{split}-{i:04d}")]


def write_sample_files(directory: Path, name: str = "sample") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for split, (n, seed) in SAMPLES[name].splits.items():
        rows = generate_split(split, n, seed, name)
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        (directory / f"{split}.jsonl").write_text(text, encoding="utf-8")


def _generated(name: str) -> Path:
    """The directory of a set written on first use: in distft's cache, named by a hash of the
    generators' code. Written whole into a temporary directory, then renamed into place: under
    torchrun several ranks may race here, and a crash leaves no half set."""
    generators = (Path(__file__), Path(sample_long.__file__), Path(__file__).with_name("sample_pairs.py"))
    code = hashlib.sha256(b"".join(path.read_bytes() for path in generators))
    final = cache_root() / "samples" / f"{name}-{code.hexdigest()[:12]}"

    def complete() -> bool:
        return all((final / f"{split}.jsonl").is_file() for split in SAMPLES[name].splits)

    if complete():
        return final
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        write_sample_files(tmp, name)
        tmp.rename(final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not complete():  # else another process's rename won: its copy is identical
            raise DataError(
                f"Cannot write the {name} meetings to {final} ({err.strerror}): delete that directory "
                "if it is there, or set DISTFT_CACHE to a writable one."
            ) from None
    return final


def sample_path(split: str, name: str = "sample") -> Path:
    """A synthetic set's split file (written first if it is generated and not there yet)."""
    if split not in SAMPLES[name].splits:
        raise ValueError(f"{name} data has splits {sorted(SAMPLES[name].splits)}, not {split!r}")
    return (SAMPLE_DIR if SAMPLES[name].bundled else _generated(name)) / f"{split}.jsonl"


def sample_files(name: str) -> list[Path]:
    """A synthetic set's files, one per split: what the token cache's key knows it by."""
    return [sample_path(split, name) for split in SAMPLES[name].splits]


if __name__ == "__main__":
    write_sample_files(SAMPLE_DIR)
    print(f"wrote {', '.join(str(sample_path(s)) for s in SAMPLE_SPLITS)}")
    print(f"sample-long: {', '.join(str(p) for p in sample_files('sample-long'))}")
