"""Vector envs: gymnasium's under SAME_STEP autoreset, envpool's Atari with CleanRL's settings and
whole-game statistics, and the checks that an env id can be made here."""

import functools
import math
import os

import gymnasium as gym
import numpy as np

from leanrl_utils.checks import fail


def check_env(env_id, atari=False, example=None):
    """One line for an --env-id that cannot be made here (envpool's list, or one gymnasium env made)."""
    if atari:
        try:
            import envpool
        except ImportError:
            fail("this script needs envpool for its Atari games: pip install 'leanrl[atari]'")
        if env_id not in envpool.list_all_envs() or not hasattr(envpool.make_spec(env_id).config, "episodic_life"):
            fail(f"unknown Atari id {env_id!r}: pass --env-id with an envpool Atari game, e.g. Breakout-v5 or Pong-v5")
        return
    if env_id not in gym.registry:
        fail(
            f"unknown environment id {env_id!r}: pass --env-id with a registered gymnasium id, e.g. {example or 'CartPole-v1'}"
        )
    env_sizes(env_id)


@functools.cache
def env_sizes(env_id):
    """A gymnasium env's flat observation and action sizes; one that cannot be made is one line."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises many types: ImportError, DependencyNotInstalled, Error
        line = (str(e).strip().splitlines() or [""])[0][:200]
        spec = gym.spec(env_id)  # a retired version: name the newest
        newest = gym.envs.registration.find_highest_version(spec.namespace, spec.name)
        other = f", e.g. {spec.id.removesuffix(f'-v{spec.version}')}-v{newest}" if newest != spec.version else ""
        why = f"{type(e).__name__}: {line}"
        fail(f"--env-id {env_id} cannot be made here ({why}): install what it needs, or pass another id{other}")
    sizes = gym.spaces.flatdim(env.observation_space), math.prod(env.action_space.shape or ())
    env.close()
    return sizes


class SameStepEnvs(gym.vector.SyncVectorEnv):
    """SyncVectorEnv under SAME_STEP autoreset with a shorter step: infos hold only the episode ends
    (final_obs, final_info), without the batching that costs more than a small env's step."""

    def __init__(self, env_fns):
        super().__init__(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    def step(self, actions):
        observations, infos = [], {}
        rewards = np.zeros(self.num_envs)
        terminations, truncations = np.zeros(self.num_envs, bool), np.zeros(self.num_envs, bool)
        for i, (env, action) in enumerate(zip(self.envs, actions)):
            obs, rewards[i], terminations[i], truncations[i], info = env.step(action)
            if terminations[i] or truncations[i]:
                infos = add_info(infos, {"final_obs": obs, "final_info": info}, i, self.num_envs)
                obs, _ = env.reset()
            observations.append(obs)
        return np.stack(observations), rewards, terminations, truncations, infos


def add_info(infos, info, i, num_envs):
    """Env i's `info` in vector infos as gymnasium lays them out: each value in an array over the envs
    (final_obs and other objects in an object array), beside its mask `_key`."""
    for key, value in info.items():
        array = infos.get(key)
        if isinstance(value, dict):
            array = add_info(array or {}, value, i, num_envs)
        else:
            if array is None and key != "final_obs" and (type(value) in (int, float, bool) or isinstance(value, np.number)):
                array = np.zeros(num_envs, type(value))
            elif array is None and key != "final_obs" and isinstance(value, np.ndarray):
                array = np.zeros((num_envs, *value.shape), value.dtype)
            elif array is None:
                array = np.full(num_envs, None, object)
            array[i] = value
        infos[key] = array
        infos.setdefault(f"_{key}", np.zeros(num_envs, bool))[i] = True
    return infos


def real_next_obs(next_obs, infos):
    """The observation each env reached (where an episode ended, infos' final_obs)."""
    if "final_obs" not in infos:
        return next_obs
    real = next_obs.copy()
    for i in np.flatnonzero(infos["_final_obs"]):
        real[i] = infos["final_obs"][i]
    return real


def ended_episodes(step, infos):
    """The episodes that ended in `infos`, as (step, return, length)."""
    info = infos.get("final_info", infos)
    if "episode" not in info:
        return []
    done = info["_episode"]
    return [(step, float(r), int(n)) for r, n in zip(info["episode"]["r"][done], info["episode"]["l"][done])]


class RecordEpisodeStatistics(gym.vector.VectorWrapper):
    """envpool Atari: returns and lengths of whole games (all lives, unclipped rewards), as gymnasium's
    vector wrapper reports them; every call counts a step, as in CleanRL."""

    def __init__(self, env):
        super().__init__(env)
        self.episode_returns = np.zeros(self.num_envs, dtype=np.float64)
        self.episode_lengths = np.zeros(self.num_envs, dtype=np.int64)

    def reset(self, **kwargs):
        obs, infos = self.env.reset(**kwargs)
        self.episode_returns[:] = 0
        self.episode_lengths[:] = 0
        return obs, infos

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = self.env.step(actions)
        # infos["reward"] is the game's own reward, before envpool's clipping to its sign.
        self.episode_returns += infos["reward"]
        self.episode_lengths += 1
        game_over = infos["terminated"].astype(bool) | truncations
        infos["episode"] = {"r": self.episode_returns.copy(), "l": self.episode_lengths.copy()}
        infos["_episode"] = game_over
        self.episode_returns[game_over] = 0
        self.episode_lengths[game_over] = 0
        return obs, rewards, terminations, truncations, infos


class RecordGameVideo(gym.vector.VectorWrapper):
    """envpool Atari: videos of env 0's whole games on gymnasium's RecordVideo schedule."""

    def __init__(self, env, video_folder, fps=15):
        # Imported here: gymnasium's save_video module raises at import without moviepy.
        from gymnasium.utils.save_video import capped_cubic_video_schedule

        super().__init__(env)
        self.schedule = capped_cubic_video_schedule
        self.video_folder, self.fps = video_folder, fps
        os.makedirs(video_folder, exist_ok=True)
        self.game, self.frames = 0, []

    def _capture(self):
        if self.schedule(self.game):
            self.frames.append(self.env.render()[0])

    def _write(self):
        from moviepy.video.io.ImageSequenceClip import ImageSequenceClip

        if len(self.frames) > 1:
            clip = ImageSequenceClip(self.frames, fps=self.fps)
            clip.write_videofile(os.path.join(self.video_folder, f"rl-video-game-{self.game}.mp4"), logger=None)
        self.frames = []

    def reset(self, **kwargs):
        obs, infos = self.env.reset(**kwargs)
        self.frames = []
        self._capture()
        return obs, infos

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = self.env.step(actions)
        self._capture()
        if infos["terminated"][0] or truncations[0]:
            self._write()
            self.game += 1
        return obs, rewards, terminations, truncations, infos

    def close(self, **kwargs):
        self._write()
        return self.env.close(**kwargs)


def envpool_envs(env_id, num_envs, seed, capture_video=False, video_folder=None):
    """`num_envs` envpool Atari games with CleanRL's settings, or one line for what is missing."""
    import importlib.util

    check_env(env_id, atari=True)
    import envpool

    if capture_video and importlib.util.find_spec("moviepy") is None:
        fail("--capture-video needs moviepy: pip install 'leanrl[video]'")
    render = {"render_mode": "rgb_array"} if capture_video else {}
    envs = envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=seed, **render
    )
    if capture_video:
        envs = RecordGameVideo(envs, video_folder)
    return RecordEpisodeStatistics(envs)
