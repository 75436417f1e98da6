"""Agent RL: agents converse with user simulators across task gyms, are trained with multi-turn GRPO on task rewards,
and are evaluated against simulators they never trained with. See docs/agent-rl.md.

Entry points: `accelerate launch agent_rl/train.py` (GRPO), `agent_rl/sft.py` (protocol SFT), `agent_rl/filtered_bc.py`
(expert iteration), `python -m agent_rl.evaluate`, `python -m agent_rl.compare`,
`python -m agent_rl.serve`. Heavy dependencies (torch, transformers, trl) load only when a model is used.
"""

from agent_rl.agents import EpisodeView, PolicyAgent, ScriptedAgent, load_agent
from agent_rl.credit import trajectory_score, turn_credits
from agent_rl.gyms import (
    GYM_NAMES,
    EpisodeResult,
    Gym,
    GymEnv,
    Task,
    UserRequest,
    get_gym,
    register_gym,
    resolve_gyms,
)
from agent_rl.protocol import AgentMove, parse_agent_text
from agent_rl.rollout import EpisodeSpec, RolloutStats, episode_specs, run_episodes
from agent_rl.users import LMUser, OpenAIUser, ScriptedUser, UserSimulator, load_simulator

__all__ = [
    "AgentMove", "EpisodeResult", "EpisodeSpec", "EpisodeView", "GYM_NAMES", "Gym", "GymEnv", "LMUser",
    "OpenAIUser", "PolicyAgent", "RolloutStats", "ScriptedAgent", "ScriptedUser", "Task", "UserRequest",
    "UserSimulator", "episode_specs", "get_gym", "load_agent", "load_simulator", "parse_agent_text", "register_gym",
    "resolve_gyms", "run_episodes", "trajectory_score", "turn_credits",
]
