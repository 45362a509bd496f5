"""gymnasium's classic-control envs as pure functions on tensors, `num_envs` envs at once, on any device.

Where the env is cheap the host is the bottleneck (PureJaxRL's lesson): with `reset` and `step` on
tensors, a rollout (policy, env step, storage) compiles to one graph and replays in a CUDA graph.
Each env copies gymnasium's source: its constants, its float64 physics (so termination flags agree
right at the thresholds), limits, rewards, termination and time limit; tests/test_envs.py checks it
transition by transition. An episode that ends restarts in the same step, as under gymnasium's
SAME_STEP autoreset, and the step also gives what RecordEpisodeStatistics and `final_obs` give.

    env = leanrl_envs.make("CartPole-v1", num_envs=64, device="cuda")
    state, obs = env.reset(seed=1)
    step = torch.compile(env.step, fullgraph=True)
    state, out = step(state, action)  # out.obs, out.reward, out.terminated, out.truncated, out.final_obs, ...
"""

import math
from typing import NamedTuple

import torch

# RANDOM NUMBERS
# Reset noise is a hash of (key, counter, env, column): Wellons' lowbias32, a bijection on 32-bit
# integers, computed in int64 on values below 2**32 (so no shift sees a sign).
# No generator state to carry or sync, and the same key gives the same draws on CPU, CUDA and compiled.
_M32 = 0xFFFFFFFF


def _mul32(x, c):
    """x * c mod 2**32: `c` as a signed 32-bit number (c - 2**32 from 2**31 on, the same residue), so
    that the product stays within int64."""
    return (x * (c - (1 << 32) if c >> 31 else c)) & _M32


def _hash32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(key, counter, num_envs, columns):
    """(num_envs, columns) float32 draws in [0, 1) with 24 random bits, the float32 mantissa."""
    index = torch.arange(num_envs * columns, device=key.device).view(num_envs, columns)
    bits = _hash32(_hash32(_hash32(key) ^ (counter & _M32)) ^ index)
    return (bits >> 8).to(torch.float32) * 2.0**-24


# THE STEP, SHARED
class State(NamedTuple):
    """Everything a step reads. A pytree of tensors: vmap, CUDA graphs and torch.save take it as is
    (a weights_only checkpoint holds `tuple(state)`; `State(*t)` rebuilds it)."""

    physics: torch.Tensor  # (num_envs, n) float64: gymnasium's `env.unwrapped.state`
    elapsed: torch.Tensor  # (num_envs,) int64: steps since reset (TimeLimit's count, the episode length)
    episode_return: torch.Tensor  # (num_envs,) float32: rewards since reset
    key: torch.Tensor  # () int64: the seed, below 2**32
    counter: torch.Tensor  # () int64: the next reset draw; one a step, for all envs


class Step(NamedTuple):
    """A step's results. Where `terminated | truncated`, `obs` already starts the next episode and
    `final_obs`, `episode_return` and `episode_length` describe the one that ended; elsewhere
    `final_obs` is `obs` and the episode fields are the running ones."""

    obs: torch.Tensor  # (num_envs, obs_dim) float32
    reward: torch.Tensor  # (num_envs,) float32
    terminated: torch.Tensor  # (num_envs,) bool
    truncated: torch.Tensor  # (num_envs,) bool: the time limit, true beside `terminated` on the last step
    final_obs: torch.Tensor
    episode_return: torch.Tensor  # (num_envs,) float32
    episode_length: torch.Tensor  # (num_envs,) int64


class Env:
    """One env's sizes and its pure `reset` and `step`; a subclass gives gymnasium's constants,
    `dynamics(physics, action) -> (physics, reward, terminated)` and `observe(physics)`."""

    id: str
    obs_dim: int
    num_actions: int
    max_episode_steps: int
    reset_low: tuple  # gymnasium's reset draws are uniform in [low, high), column by column
    reset_high: tuple

    def __init__(self, num_envs, device="cpu"):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self._low = torch.tensor(self.reset_low, dtype=torch.float64, device=self.device)
        self._high = torch.tensor(self.reset_high, dtype=torch.float64, device=self.device)

    def __repr__(self):
        return f"{type(self).__name__}({self.id}, num_envs={self.num_envs}, device={self.device})"

    def _draw(self, key, counter, num_envs):
        u = uniform(key, counter, num_envs, len(self.reset_low)).to(torch.float64)
        return self._low + (self._high - self._low) * u

    def state_from(self, physics, elapsed=None, seed=0):
        """A state at given physical states (gymnasium's `env.unwrapped.state`, one row per env)."""
        physics = torch.as_tensor(physics, dtype=torch.float64, device=self.device)
        n = physics.shape[0]
        elapsed = torch.zeros(n, dtype=torch.int64) if elapsed is None else torch.as_tensor(elapsed, dtype=torch.int64)
        elapsed = elapsed.to(self.device)
        key = torch.as_tensor(seed, dtype=torch.int64, device=self.device) & _M32
        episode_return = torch.zeros(n, dtype=torch.float32, device=self.device)
        counter = torch.ones((), dtype=torch.int64, device=self.device)  # counter 0 drew the first reset
        return State(physics, elapsed, episode_return, key, counter)

    def reset(self, seed=0):
        """(state, obs) for all envs; `seed` (an int or a 0-d tensor) is the key of every later draw."""
        key = torch.as_tensor(seed, dtype=torch.int64, device=self.device) & _M32
        state = self.state_from(self._draw(key, torch.zeros_like(key), self.num_envs), seed=key)
        return state, self.observe(state.physics)

    def step(self, state, action):
        """(state, Step) after one action (an integer tensor, (num_envs,)) in every env."""
        physics, reward, terminated = self.dynamics(state.physics, action)
        elapsed = state.elapsed + 1
        truncated = elapsed >= self.max_episode_steps
        done = terminated | truncated
        episode_return = state.episode_return + reward
        fresh = self._draw(state.key, state.counter, physics.shape[0])
        final_obs = self.observe(physics)
        physics = torch.where(done[:, None], fresh, physics)
        out = Step(self.observe(physics), reward, terminated, truncated, final_obs, episode_return, elapsed)
        state = State(
            physics,
            torch.where(done, 0, elapsed),
            torch.where(done, 0.0, episode_return),
            state.key,
            state.counter + 1,
        )
        return state, out


# CARTPOLE: gymnasium/envs/classic_control/cartpole.py, euler integration, reward 1 on every step
class CartPole(Env):
    id = "CartPole-v1"
    obs_dim = 4
    num_actions = 2
    max_episode_steps = 500
    reset_low, reset_high = (-0.05,) * 4, (0.05,) * 4
    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masspole + masscart
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02
    theta_threshold_radians = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def dynamics(self, s, action):
        x, x_dot, theta, theta_dot = s.unbind(1)
        force = torch.where(action == 1, self.force_mag, -self.force_mag).to(s.dtype)
        costheta = torch.cos(theta)
        sintheta = torch.sin(theta)
        temp = (force + self.polemass_length * theta_dot.square() * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta.square() / self.total_mass)
        )
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        terminated = (
            (x < -self.x_threshold)
            | (x > self.x_threshold)
            | (theta < -self.theta_threshold_radians)
            | (theta > self.theta_threshold_radians)
        )
        reward = torch.ones_like(x, dtype=torch.float32)
        return torch.stack([x, x_dot, theta, theta_dot], 1), reward, terminated

    def observe(self, s):
        return s.float()


# ACROBOT: gymnasium/envs/classic_control/acrobot.py, the book's dynamics, one rk4 step of dt
class Acrobot(Env):
    id = "Acrobot-v1"
    obs_dim = 6
    num_actions = 3
    max_episode_steps = 500
    reset_low, reset_high = (-0.1,) * 4, (0.1,) * 4  # gymnasium rounds these draws to float32, here they stay float64
    dt = 0.2
    LINK_LENGTH_1 = 1.0
    LINK_MASS_1 = 1.0
    LINK_MASS_2 = 1.0
    LINK_COM_POS_1 = 0.5
    LINK_COM_POS_2 = 0.5
    LINK_MOI = 1.0
    MAX_VEL_1 = 4 * math.pi
    MAX_VEL_2 = 9 * math.pi

    def _dsdt(self, s, a):
        """gymnasium's `_dsdt`, term for term (the same float64 rounding), without the torque's zero."""
        m1, m2, l1 = self.LINK_MASS_1, self.LINK_MASS_2, self.LINK_LENGTH_1
        lc1, lc2, I1, I2 = self.LINK_COM_POS_1, self.LINK_COM_POS_2, self.LINK_MOI, self.LINK_MOI
        g, pi, cos, sin = 9.8, math.pi, torch.cos, torch.sin
        theta1, theta2, dtheta1, dtheta2 = s
        d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * cos(theta2)) + I1 + I2
        d2 = m2 * (lc2**2 + l1 * lc2 * cos(theta2)) + I2
        phi2 = m2 * lc2 * g * cos(theta1 + theta2 - pi / 2.0)
        phi1 = (
            -m2 * l1 * lc2 * dtheta2**2 * sin(theta2)
            - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * sin(theta2)
            + (m1 * lc1 + m2 * l1) * g * cos(theta1 - pi / 2)
            + phi2
        )
        ddtheta2 = (a + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * sin(theta2) - phi2) / (m2 * lc2**2 + I2 - d2**2 / d1)
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return dtheta1, dtheta2, ddtheta1, ddtheta2

    def dynamics(self, s, action):
        torque = (action - 1).to(s.dtype)
        y0 = s.unbind(1)
        dt, dt2 = self.dt, self.dt / 2.0
        k1 = self._dsdt(y0, torque)
        k2 = self._dsdt([y + dt2 * k for y, k in zip(y0, k1)], torque)
        k3 = self._dsdt([y + dt2 * k for y, k in zip(y0, k2)], torque)
        k4 = self._dsdt([y + dt * k for y, k in zip(y0, k3)], torque)
        theta1, theta2, dtheta1, dtheta2 = [
            y + dt / 6.0 * (a + 2 * b + 2 * c + d) for y, a, b, c, d in zip(y0, k1, k2, k3, k4)
        ]
        theta1 = self._wrap(theta1)
        theta2 = self._wrap(theta2)
        dtheta1 = dtheta1.clamp(-self.MAX_VEL_1, self.MAX_VEL_1)
        dtheta2 = dtheta2.clamp(-self.MAX_VEL_2, self.MAX_VEL_2)
        terminated = -torch.cos(theta1) - torch.cos(theta2 + theta1) > 1.0
        reward = terminated.float() - 1.0
        return torch.stack([theta1, theta2, dtheta1, dtheta2], 1), reward, terminated

    @staticmethod
    def _wrap(x, m=-math.pi, M=math.pi):
        """gymnasium's `wrap` loops `x -= M - m` while `x > M` (and up while `x < m`); the count in
        one go gives its bits for one turn, and within an ulp a turn for the few that extreme speeds make."""
        diff = M - m
        return x - diff * torch.ceil((x - M) / diff).clamp(min=0) + diff * torch.ceil((m - x) / diff).clamp(min=0)

    def observe(self, s):
        theta1, theta2, dtheta1, dtheta2 = s.unbind(1)
        return torch.stack([theta1.cos(), theta1.sin(), theta2.cos(), theta2.sin(), dtheta1, dtheta2], 1).float()


# MOUNTAINCAR: gymnasium/envs/classic_control/mountain_car.py, velocity clipped before the position moves
class MountainCar(Env):
    id = "MountainCar-v0"
    obs_dim = 2
    num_actions = 3
    max_episode_steps = 200
    reset_low, reset_high = (-0.6, 0.0), (-0.4, 0.0)
    min_position = -1.2
    max_position = 0.6
    max_speed = 0.07
    goal_position = 0.5
    goal_velocity = 0
    force = 0.001
    gravity = 0.0025

    def dynamics(self, s, action):
        position, velocity = s.unbind(1)
        velocity = velocity + ((action - 1).to(s.dtype) * self.force + torch.cos(3 * position) * (-self.gravity))
        velocity = velocity.clamp(-self.max_speed, self.max_speed)
        position = (position + velocity).clamp(self.min_position, self.max_position)
        velocity = torch.where((position == self.min_position) & (velocity < 0), 0.0, velocity)
        terminated = (position >= self.goal_position) & (velocity >= self.goal_velocity)
        reward = torch.full_like(position, -1.0, dtype=torch.float32)
        return torch.stack([position, velocity], 1), reward, terminated

    def observe(self, s):
        return s.float()


ENVS = {env.id: env for env in (CartPole, Acrobot, MountainCar)}


def make(env_id, num_envs, device="cpu"):
    """The torch-native twin of `gym.make_vec(env_id, num_envs)`; the seed goes to `reset`."""
    if env_id not in ENVS:
        raise ValueError(f"no torch-native env {env_id!r}: leanrl_envs has {', '.join(ENVS)}")
    return ENVS[env_id](num_envs, device)
