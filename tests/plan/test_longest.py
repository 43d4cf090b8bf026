"""The longest sequence per layout: the edge of the memory model, and the model's positions."""

from distft.cli import build_parser
from distft.plan import evaluate, make_request
from distft.plan.longest import STEP, fits_at, longest_sequences, positions_limit


def request(command: str):
    return make_request(build_parser().parse_args(["plan", *command.split()]))


def test_the_longest_sequence_is_the_edge_of_what_fits_up_to_the_positions():
    req = request("--model Qwen/Qwen3-4B --gpus 2 --gpu rtx4090 --rope-scaling yarn --rope-factor 4")
    assert positions_limit(req) == 131_072
    names = [name for name, e in evaluate(req).items() if e.applicable]
    longest = longest_sequences(req, names)
    assert set(longest) == set(names)
    for name, by_level in longest.items():
        assert list(by_level) == ["none", "offload"]
        assert by_level["offload"] >= by_level["none"] > 0, name  # offload keeps the least
        for level, seq in by_level.items():
            assert fits_at(req, name, seq, level), (name, level)
            assert seq == 131_072 or not fits_at(req, name, seq + STEP, level), (name, level)
    assert longest["tp-sp"]["none"] > longest["single"]["none"]  # SP splits the activations
    # Without scaling the model's own 40,960 positions bound the search, whatever fits.
    plain = request("--model Qwen/Qwen3-4B --gpus 2 --gpu h200")
    assert positions_limit(plain) == 40_960
    assert longest_sequences(plain, ["single"])["single"]["offload"] == 40_960
    # Loss on every position (text rows): the loss head grows with the sequence too.
    text = request(
        "--model Qwen/Qwen3-4B --gpu rtx4090 --seq-len 2048 --label-tokens 2048 "
        "--rope-scaling yarn --rope-factor 4 --activation-checkpointing offload"
    )
    assert longest_sequences(text, ["single"])["single"]["offload"] < longest["single"]["offload"]
