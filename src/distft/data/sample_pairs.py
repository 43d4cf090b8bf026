"""`sample-pairs`: the bundled meetings (`distft.data.sample`) as preference rows, each true summary
chosen and, rejected, the same summary with one detail the meeting never had: three rows a meeting,
one per kind of detail (`distft.data.sample.generate_meeting_pairs`)."""

from __future__ import annotations

import random
import re

from distft.data.sample_long import DAYS, NAMES

ERRORS = ("day", "decision", "owner")


def with_unsaid_detail(meeting: dict[str, str], domains: list[dict], error: str) -> dict[str, str]:
    """A meeting ({"id", "transcript", "summary"}, its items' options in `domains`) as a preference
    row: {"id", "transcript", "chosen", "rejected", "error"}, the true summary chosen and, rejected,
    the same summary with one detail the meeting never had: an action item's day, a decision's option
    or an action item's owner (`error`: day, decision or owner) replaced by one of the same kind that
    nobody said. As fluent, and wrong about the meeting: the hallucinated detail a summariser is
    taught to avoid. The wrong detail is drawn from the meeting's id."""
    meeting_id, transcript, summary = meeting["id"], meeting["transcript"], meeting["summary"]
    rng = random.Random(f"{error} of {meeting_id}")

    def unsaid(candidates: list[str]) -> list[str]:
        return [c for c in candidates if not re.search(rf"\b{re.escape(c)}\b", transcript)]

    actions = re.findall(r"(\w+) will (.+?) by ([^.]+)\.", summary)
    if error == "decision":
        decided = re.search(r"agreed on (.+?) for (.+?)(?:,| and |\.)", summary)
        value, item = decided.group(1), decided.group(2)
        options = next(
            [f"{o} {unit}".strip() for o in options]  # as the summary writes a value
            for d in domains
            for name, options, unit in d["items"]
            if name == item
        )
        wrong = rng.choice(unsaid(options))
        rejected = summary.replace(f"agreed on {value} for {item}", f"agreed on {wrong} for {item}", 1)
    else:
        owner, task, day = rng.choice(actions)
        said = f"{owner} will {task} by {day}."
        wrong = (
            f"{rng.choice(unsaid(NAMES))} will {task} by {day}."
            if error == "owner"
            else (f"{owner} will {task} by {rng.choice(unsaid(DAYS))}.")
        )
        rejected = summary.replace(said, wrong)
    assert rejected != summary, meeting_id
    return {
        "id": f"{meeting_id}-{error}",
        "transcript": transcript,
        "chosen": summary,
        "rejected": rejected,
        "error": error,
    }
