"""Whole synthetic meetings of 4,655-28,092 tokens, for long-context finetuning (`--data sample-long`).

AMI's meetings run a median of ~9-10k Qwen3 tokens (p90 13-15k, the longest 20.5k); the bundled
`sample` meetings are a few hundred. These fill a 32k context: 4-6 people work through 8-40 agenda
items (a workstream's budget, deadline, lead, ...), each over several rounds of proposals, facts,
objections and asides, closed by one decision line (`we decide on VALUE for ITEM.`) and never
recapped. The summary names every item's decision in a few hundred tokens, so a model that reads
only part of a meeting cannot write it: the decisions are spread through the whole transcript, and
the options turned down and the figures quoted on the way are the wrong answers near each one.

Length is planned in characters (standard library only, no tokenizer): a target drawn from a
triangular distribution over `TOKENS` (mode 8k, median ~13k: most meetings AMI-sized, a tail to
30k), at `CHARS_PER_TOKEN`, the items filled up to it in turn, so that the items' overshoots do not
add up. Byte-identical on every machine: `random.Random`, and only arithmetic IEEE 754 rounds
exactly (`triangular` takes a square root; no log or exp, whose last bit varies by libm).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

TOKENS = (4500, 8000, 30000)  # a meeting's planned length (low, mode, high): over 4k, under 32k with
# the summary and the prompt (a transcript's characters per token vary by +-5%)
CHARS_PER_TOKEN = 3.8  # these meetings with the Qwen3 tokenizer (tests/data/test_sample.py checks)
TOKENS_PER_ITEM = (600, 850)  # how long an item is discussed: sets the item count, 8 to 40
ITEMS = (8, 40)

NAMES = [
    "Anna", "Tom", "Priya", "Marco", "Lena", "David", "Sofia", "Kenji", "Grace", "Omar", "Julia", "Felix",
    "Mei", "Lucas", "Nora", "Samuel", "Ines", "Victor", "Hana", "Ravi", "Claire", "Jonas", "Amara", "Paul",
]  # fmt: skip
FILLERS = ["um", "uh", "yeah", "okay", "so", "well", "I mean", "you know"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "next week", "the end of the month"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]  # fmt: skip
COUNTS = ["two", "three", "four", "five", "six", "seven", "eight", "nine"]

# A programme meeting: its purpose, six roles, and twelve workstreams (no name a prefix of another).
DOMAINS: list[tuple[str, list[str], list[str]]] = [
    ("launch the new television remote control",
     ["project manager", "marketing expert", "interface designer", "industrial designer", "controller", "quality engineer"],
     ["the case design", "the button layout", "the battery module", "the voice feature", "the user testing", "the packaging",
      "the user manual", "the marketing campaign", "the retail partners", "the production run", "the launch event", "the warranty service"]),
    ("open the new regional office",
     ["office manager", "facilities lead", "IT lead", "HR partner", "finance manager", "team lead"],
     ["the office lease", "the furniture", "the network setup", "the security system", "the hiring plan", "the relocation support",
      "the opening party", "the kitchen area", "the meeting rooms", "the parking spaces", "the cleaning contract", "the signage"]),
    ("organise the annual customer conference",
     ["event coordinator", "marketing expert", "sales lead", "logistics manager", "finance manager", "speaker liaison"],
     ["the venue booking", "the catering", "the keynote programme", "the workshop track", "the registration site", "the hotel block",
      "the sponsor packages", "the printed material", "the video recording", "the shuttle buses", "the evening dinner", "the feedback survey"]),
    ("prepare the next major software release",
     ["engineering manager", "backend developer", "frontend developer", "tester", "release manager", "support lead"],
     ["the payment module", "the search rewrite", "the mobile app", "the offline mode", "the data migration", "the load testing",
      "the security audit", "the beta programme", "the release notes", "the support training", "the monitoring dashboards", "the rollback plan"]),
    ("plan the warehouse reorganisation",
     ["operations manager", "warehouse lead", "safety officer", "logistics planner", "finance manager", "IT lead"],
     ["the shelving layout", "the loading docks", "the forklift fleet", "the inventory system", "the night shift", "the safety training",
      "the returns area", "the packing stations", "the barcode scanners", "the overflow storage", "the cleaning schedule", "the lighting upgrade"]),
]  # fmt: skip

COMPANIES = ["Norland Systems", "Brightwell", "Castor Group", "Helix Partners", "Mirando", "Ostara Works",
             "Pellham Services", "Quarry Lane", "Rivetta", "Solberg Consulting", "Tamsin Labs", "Vireo Supply"]  # fmt: skip
RHYTHMS = ["a weekly review", "a review every two weeks", "a monthly review", "a review at each milestone",
           "a short daily check-in", "a review every six weeks"]  # fmt: skip
CITIES = ["Lyon", "Hamburg", "Utrecht", "Porto", "Gdansk", "Turin", "Ghent", "Malmo", "Leeds", "Graz"]
STEPS = ["a small pilot", "a written plan", "a call with the suppliers", "a workshop with users",
         "a cost review", "a quick prototype", "a survey of the customers"]  # fmt: skip


@dataclass(frozen=True)
class Attribute:
    """What a meeting decides about a workstream: the item is "the {name} for {workstream}"."""

    name: str
    value: Callable[[random.Random, list[str]], str]  # one candidate, from the attendees' names too
    doubts: tuple[str, ...]  # objections to {value}
    facts: tuple[str, ...]  # context that quotes figures: {n} (a count), {k} (thousands), {p}, {ws}, {name}


ATTRIBUTES = [
    Attribute("budget", lambda rng, _: f"{rng.randrange(5, 96)} thousand euros",
              ("{value} will not cover the contractors.", "{value} is more than finance will sign off on.",
               "with {value} there is nothing left for surprises."),
              ("Last year we spent about {k} thousand euros on {ws}.", "The first quote for {ws} was {k} thousand.")),
    Attribute("deadline", lambda rng, _: f"{rng.choice(MONTHS)} {rng.randint(1, 28)}",
              ("{value} is too early, we would have to skip the testing.", "{value} clashes with the holidays.",
               "by {value} half the team is still on the other project."),
              ("The suppliers need about {n} weeks' notice for {ws}.", "{ws} slipped by {n} weeks last time.")),
    Attribute("lead", lambda rng, names: rng.choice(names),
              ("{value} already has a lot on the plate.", "{value} is away for two weeks around then.",
               "{value} has not worked on anything like this before."),
              ("{name} did something similar on the last project.", "Nobody has owned {ws} for {n} months.")),
    Attribute("partner", lambda rng, _: rng.choice(COMPANIES),
              ("{value} delivered late last time.", "{value} is quite expensive for what they offer.",
               "I have never heard of {value}, to be honest."),
              ("We got {n} offers for {ws} so far.", "Two of the offers for {ws} were around {k} thousand.")),
    Attribute("team size", lambda rng, _: f"{rng.choice(COUNTS)} people",
              ("{value} is more than we can free up.", "{value} sounds too small for the amount of work."),
              ("Right now {n} people work on {ws} part time.", "The other team used {n} people for this.")),
    Attribute("review rhythm", lambda rng, _: rng.choice(RHYTHMS),
              ("{value} means a lot of meetings.", "{value} might be too slow to catch problems."),
              ("Nobody looked at {ws} for {n} weeks on the last project.", "We have {n} reviews a month already.")),
    Attribute("success target", lambda rng, _: f"{rng.randint(60, 99)} percent",
              ("{value} is not realistic with the current team.", "{value} sounds low, the customers expect more."),
              ("Last time we reached about {p} percent on {ws}.", "The survey said {p} percent were happy.")),
    Attribute("test location", lambda rng, _: rng.choice(CITIES),
              ("{value} is far away for most of us.", "we have no contacts in {value} yet."),
              ("About {p} percent of the customers for {ws} are in the south.", "We tested {ws} in {n} cities before.")),
    Attribute("first step", lambda rng, _: rng.choice(STEPS),
              ("{value} takes too long before we learn anything.", "I'm not sure {value} tells us enough."),
              ("We know very little about {ws} yet.", "The last {n} attempts at {ws} started too big.")),
]  # fmt: skip
INTROS = ["Next on the list is {item}.", "Okay, let's move on to {item}.", "Right, {item}. {name}, do you want to start?",
          "The next point is {item}.", "Let's look at {item} now.", "Good. Then {item}, which could take a while."]  # fmt: skip
PROPOSALS = ["I would suggest {value} for {item}.", "What about {value}? I think that could work for {item}.",
             "From my side, {value} makes the most sense for {item}.", "My proposal would be {value}.",
             "I'd go with {value}, to be honest.", "Looking at the numbers, {value} seems right to me."]  # fmt: skip
REASONS = ["That is what we did on the last project.", "It keeps the risk low.", "The customers asked for something like that.",
           "It fits the rest of the plan.", "It gives us some room later.", "It is also the easiest to explain to management."]  # fmt: skip
REPLIES = ["Fair point.", "Okay, I see that.", "Hmm, maybe.", "That is true, I had not thought of that.",
           "Well, we could still look at it.", "I don't fully agree, but okay."]  # fmt: skip
QUESTIONS = ["Do we have numbers on that?", "What did we do last time?", "{name}, what do you think?",
             "Is that realistic with the current plan?", "Who would have to sign that off?", "How does that affect {ws}?"]  # fmt: skip
ANSWERS = ["Not really, we would have to check.", "Last time it was a bit of a mess, honestly.",
           "I think it is fine, but let's be careful.", "Finance would have to sign it off.",
           "I can look it up after the meeting.", "It depends a lot on the other items, I think."]  # fmt: skip
REMARKS = ["I talked to the people working on {ws} yesterday.", "{ws} is a bit behind anyway.",
           "We should not forget that the other workstreams depend on {ws}.", "The board asked about {ws} last week.",
           "Let's not spend the whole meeting on {ws}."]  # fmt: skip
ASIDES = ["Mm-hmm.", "Yeah.", "Okay.", "Right.", "Sure.", "Yes, go on.", "Sorry, can you repeat that? The sound cut out.",
          "Can everyone see the slides?", "Let me just write that down.", "Sorry, my microphone was muted.",
          "Should we take a short break after this one?", "Hang on, someone is at the door."]  # fmt: skip
RETURNS = ["Okay, then let's go back to {value}.", "So what about {value} after all?",
           "I think {value} is the safest choice for {item}.", "Could we agree on {value}?"]  # fmt: skip
FRESH = ["What about {value}? We have not talked about that yet.", "There is also {value}, nobody mentioned it so far.",
         "Maybe {value} is the middle ground for {item}."]  # fmt: skip
SUPPORT = ["I agree, {value} is a good choice.", "Yeah, {value} fits what the customers told us.",
           "Fine with me, let's go with {value}.", "That makes sense, {value} it is.", "I can live with {value}."]  # fmt: skip
DECIDE = ["So", "Okay, then", "Good, so", "Fine, then", "Alright, so"]  # "... we decide on VALUE for ITEM."
TASKS = ["prepare the detailed plan", "check the costs with finance", "draft the presentation", "contact the partners",
         "update the project plan", "collect feedback from users", "write up the decisions", "book the next meeting"]  # fmt: skip


def _say(rng: random.Random, who: str, template: str, **fill: object) -> str:
    """One turn in spoken style: an occasional filler word first (added before the values go in,
    so a name keeps its capital), the turn's first letter a capital ("{ws} is behind": "The ...")."""
    if rng.random() < 0.3:
        keep_case = template.startswith(("I ", "I'"))
        filler = rng.choice(FILLERS).capitalize()
        template = f"{filler}, {template if keep_case else template[0].lower() + template[1:]}"
    text = template.format(**fill)
    return f"{who}: {text[0].upper()}{text[1:]}"


def _options(rng: random.Random, attr: Attribute, names: list[str]) -> list[str]:
    """Three distinct candidate values; the first is the one decided."""
    options: list[str] = []
    while len(options) < 3:
        value = attr.value(rng, names)
        options += [] if value in options else [value]
    return options


def _beat(
    rng: random.Random, names: list[str], attr: Attribute, fill: dict, value: str
) -> tuple[list[str], bool]:
    """One exchange on an item: a proposal of `value` and its objection, a fact, a question and its
    answer, or a remark, each with an occasional aside; and whether it proposed `value`."""
    a, b = rng.sample([n for n in names if n != value], 2)  # nobody doubts themselves as lead
    fill = {**fill, "value": value, "name": b}
    kind = rng.random()
    if kind < 0.5:
        reason = f" {rng.choice(REASONS)}" if rng.random() < 0.5 else ""
        doubt = (
            rng.choice(attr.doubts)
            if rng.random() < 0.7
            else "I'm not sure about {value}, let's hear the others."
        )
        lines = [_say(rng, a, rng.choice(PROPOSALS) + reason, **fill), _say(rng, b, doubt, **fill)]
        lines += [f"{a}: {rng.choice(REPLIES)}"] if rng.random() < 0.5 else []
    elif kind < 0.7:
        lines = [_say(rng, a, rng.choice(attr.facts), **fill)]
    elif kind < 0.85:
        lines = [_say(rng, a, rng.choice(QUESTIONS), **fill), _say(rng, b, rng.choice(ANSWERS))]
    else:
        lines = [_say(rng, a, rng.choice(REMARKS), **fill)]
    lines += [f"{rng.choice(names)}: {rng.choice(ASIDES)}"] if rng.random() < 0.25 else []
    return lines, kind < 0.5


def _discuss(
    rng: random.Random, names: list[str], chair: str, attr: Attribute, ws: str, goal: int, done: int
) -> tuple[list[str], str]:
    """One agenda item, discussed until the meeting's text reaches `goal` characters (`done` so far),
    over two proposals at least, then decided in one line; and the value decided."""
    item = f"the {attr.name} for {ws}"
    chosen, *rejected = _options(rng, attr, names)
    # The item's figures, drawn once: its facts agree with each other.
    fill = {
        "item": item,
        "ws": ws,
        "n": rng.randint(2, 12),
        "k": rng.randrange(5, 96),
        "p": rng.randint(40, 95),
    }
    lines = [_say(rng, chair, rng.choice(INTROS), **fill, name=rng.choice(names[1:]))]
    proposals, chosen_said = 0, False
    while proposals < 2 or done + sum(len(line) + 1 for line in lines) < goal:
        value = chosen if rng.random() < 0.25 else rng.choice(rejected)
        beat, proposed = _beat(rng, names, attr, fill, value)
        proposals += proposed
        chosen_said |= proposed and value == chosen
        lines += beat
    a, b = rng.sample([n for n in names if n != chosen], 2)
    lines.append(_say(rng, a, rng.choice(RETURNS if chosen_said else FRESH), **fill, value=chosen))
    lines.append(_say(rng, b, rng.choice(SUPPORT), value=chosen))
    lines.append(f"{chair}: {rng.choice(DECIDE)} we decide on {chosen} for {item}.")
    return lines, chosen


def _and(parts: list[str]) -> str:
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else parts[0]


def generate_long_meeting(rng: random.Random, meeting_id: str) -> dict[str, str]:
    """One long meeting: {"id", "transcript", "summary"}."""
    purpose, roles, workstreams = rng.choice(DOMAINS)
    tokens = rng.triangular(TOKENS[0], TOKENS[2], TOKENS[1])
    goal = int(tokens * CHARS_PER_TOKEN)
    n_items = min(max(round(tokens / rng.uniform(*TOKENS_PER_ITEM)), ITEMS[0]), ITEMS[1])
    pairs = sorted(rng.sample(range(len(workstreams) * len(ATTRIBUTES)), n_items))
    items = [(workstreams[i // len(ATTRIBUTES)], ATTRIBUTES[i % len(ATTRIBUTES)]) for i in pairs]
    names = rng.sample(NAMES, rng.randint(4, 6))
    chair = names[0]

    lines = [f"{chair}: Okay, let's get started. Today we need to {purpose}, and we have {n_items} points."]
    lines += [_say(rng, n, "Hi, I am {n}, the {r}.", n=n, r=r) for n, r in zip(names, roles, strict=False)]
    agenda: dict[str, list[str]] = {}
    for ws, attr in items:
        agenda.setdefault(ws, []).append(attr.name)
    lines += [f"{chair}: For {ws}, the {_and(attrs)}." for ws, attrs in agenda.items()]
    closing = 400  # the action items and goodbye, roughly
    start = sum(len(line) + 1 for line in lines)
    decided: dict[str, list[str]] = {}
    for i, (ws, attr) in enumerate(items):
        goal_here = start + (goal - start - closing) * (i + 1) // n_items
        discussion, value = _discuss(rng, names, chair, attr, ws, goal_here, sum(len(ln) + 1 for ln in lines))
        lines += discussion
        decided.setdefault(ws, []).append(f"{value} for the {attr.name}")

    owners_tasks = zip(rng.sample(names, 3), rng.sample(TASKS, 3), strict=True)
    actions = [(owner, task, rng.choice(DAYS)) for owner, task in owners_tasks]
    lines.append(f"{chair}: Okay, that was everything. Action items.")
    lines += [_say(rng, owner, f"I will {task} by {day}.") for owner, task, day in actions]
    lines.append(f"{chair}: Great, thanks everyone, that was a long one. See you next time.")

    summary = [f"The team met to {purpose} and decided {n_items} points."]
    summary += [f"{ws[0].upper()}{ws[1:]}: {_and(values)}." for ws, values in decided.items()]
    summary += [f"{owner} will {task} by {day}." for owner, task, day in actions]
    return {"id": meeting_id, "transcript": "\n".join(lines), "summary": " ".join(summary)}
