"""The `[dpo]` section of the run configuration (`distft.config.schema`): the settings of the
preference objectives (`train.objective = dpo | orpo | kto`, `distft.model.preference`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PreferenceConfig:
    beta: float = 0.1
    """DPO's and KTO's beta (how far the policy may move from the reference; IPO's tau), or ORPO's
    lambda (the weight of its odds-ratio term beside the SFT loss)."""
    loss_type: str = "sigmoid"
    """DPO's loss of the reward margin: sigmoid (the DPO paper's), ipo (squared, per token) or hinge (SLiC)."""
    label_smoothing: float = 0.0
    """DPO sigmoid only: the share of pairs assumed mislabelled (conservative DPO); 0: plain DPO."""
    desirable_weight: float = 1.0
    """KTO: the weight of a desirable answer's loss (KTO's lambda_D). With unbalanced data, keep
    desirable_weight x desirable rows / (undesirable_weight x undesirable rows) within 1 to 4/3."""
    undesirable_weight: float = 1.0
    """KTO: the weight of an undesirable answer's loss (KTO's lambda_U)."""
    precompute_reference: bool = False
    """DPO and KTO: the reference's log-probabilities computed once, before the first step, with the model
    as it starts, and kept in the run directory for a resume; needed for --method full (derived
    there). Off: the base under the disabled LoRA adapters, in every step's forward."""
    max_prompt_length: int = 0
    """DPO, ORPO and KTO: a prompt's last tokens kept, its start cut (TRL's DPOConfig); 0: no limit.
    Cut before data.max_length applies."""
    max_completion_length: int = 0
    """DPO, ORPO and KTO: each answer's first tokens kept, its end cut (TRL's DPOConfig); 0: no limit."""
