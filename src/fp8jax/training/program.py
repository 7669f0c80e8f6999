"""The train step of ``fp8jax train``: the model, the optimizer, the jitted step and its state."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp8jax import xla_options
from fp8jax.flax import FP8_COLLECTION, TrainState, make_train_step
from fp8jax.models.gpt import Gpt, next_token_loss
from fp8jax.recipes import DelayedScaling
from fp8jax.training import mesh as mesh_lib
from fp8jax.training.config import RunConfig


class TrainProgram:
    """The model, the jitted train and eval steps, and the initial state of a run.

    Public so that benchmarks time exactly the step ``fp8jax train`` runs
    (``step``, jitted as ``fp8jax train`` runs it; ``raw_step`` before jit
    and donation; bench/gpt.py).

    ``materialize=False`` leaves ``initial_state`` abstract
    (``jax.ShapeDtypeStruct`` leaves), for compiles and memory estimates of
    models larger than the machine holds.
    """

    def __init__(self, config: RunConfig, mesh, attention: str, unroll_layers: bool = True,
                 *, materialize: bool = True):  # fmt: skip
        recipe = config.fp8_recipe()
        self.config, self.mesh = config, mesh
        if attention == "auto":
            attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
        self.attention = attention  # as the run's summary names it
        # "fp8-hadamard": the FP8 attention with its Hadamard rotation of Q and K.
        hadamard = attention == "fp8-hadamard"
        self.model = Gpt(
            config=config.model,
            precision=config.precision,
            recipe=recipe,
            attention_implementation="fp8" if hadamard else attention,
            attention_hadamard=hadamard,
            unroll_layers=unroll_layers,
            remat=config.remat,
        )
        tx = config.optimizer()
        tokens = jnp.zeros((config.batch_size, config.seq_len), jnp.int32)
        shardings = None
        if mesh is not None:
            boxed = jax.eval_shape(self.model.init, jax.random.key(0), tokens)["params"]
            shardings = mesh_lib.param_shardings(boxed, mesh)

        def create(key):
            variables = nn.meta.unbox(self.model.init(key, tokens))
            # MoE blocks sow routing statistics at init too; the state keeps none.
            variables = {k: v for k, v in variables.items() if k in ("params", FP8_COLLECTION)}
            if shardings is None:
                return TrainState.create(variables, tx)
            constrain = jax.lax.with_sharding_constraint
            params = constrain(variables["params"], shardings)
            state = TrainState.create(variables | {"params": params}, tx)
            # AdamW's moments are sharded like the params they follow (FSDP proper).
            opt_state = optax.tree_map_params(tx, constrain, state.opt_state, shardings)
            return state._replace(opt_state=opt_state)

        key = jax.random.key(config.seed)
        # The parameters (and so AdamW's moments) are f32, the master weights;
        # the modules cast them to BF16 or FP8 for each GEMM.
        if materialize:
            self.initial_state = jax.jit(create)(key)
        else:
            self.initial_state = jax.eval_shape(create, key)
        delayed = recipe if isinstance(recipe, DelayedScaling) else None
        self.raw_step = make_train_step(
            self.loss, tx, accumulation_steps=config.accumulation_steps, recipe=delayed
        )
        out_shardings, self.batch_sharding = None, None
        # The rows of every batch this process loads: all of them, unless the mesh
        # spans several processes (fp8jax.training.distributed).
        self.rows = slice(0, config.batch_size)
        if mesh is not None and materialize:
            state_shardings = jax.tree.map(lambda a: a.sharding, self.initial_state)
            out_shardings = (state_shardings, mesh_lib.replicated(mesh))
            self.batch_sharding = mesh_lib.batch_sharding(mesh)
            self.rows = mesh_lib.process_rows(self.batch_sharding, config.batch_size)
        # fp8jax owns this jit, so it compiles with its own options: the FP8 GEMMs
        # go to cuBLASLt without minutes of Triton autotuning
        # (docs/design.md#first-compile-time).
        options = xla_options.compiler_options()
        self.step = jax.jit(
            self.raw_step, out_shardings=out_shardings, donate_argnums=0, compiler_options=options
        )
        self.eval = jax.jit(self._eval_loss, compiler_options=options)
        self.routing = jax.jit(self._routing, compiler_options=options)
        self.all_finite = jax.jit(
            lambda tree: jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]).all()
        )

    @property
    def layers(self) -> str:
        """``"unrolled"`` or ``"rolled"``: how the step runs the scan over layers."""
        return "unrolled" if self.model.unroll_layers else "rolled"

    @property
    def moe(self) -> bool:
        """Whether the model has MoE layers."""
        return bool(self.config.model.experts)

    def loss(self, variables, batch):
        """The next-token loss; with MoE layers plus ``moe_aux_weight`` times their mean
        load-balancing loss."""
        if not self.moe:
            return next_token_loss(self.model.apply(variables, batch[:, :-1]), batch[:, 1:])
        logits, sown = self.model.apply(variables, batch[:, :-1], mutable=["intermediates"])
        aux = jnp.mean(jnp.concatenate([a.reshape(-1) for a in jax.tree.leaves(sown)]))
        return next_token_loss(logits, batch[:, 1:]) + self.config.moe_aux_weight * aux

    def _variables(self, state):
        variables = {"params": state.params}
        if state.fp8_state:
            variables[FP8_COLLECTION] = state.fp8_state
        return variables

    def _eval_loss(self, state, batch):
        # The next-token loss alone, so that validation losses compare across aux weights.
        variables = self._variables(state)
        return next_token_loss(self.model.apply(variables, batch[:, :-1]), batch[:, 1:])

    def _routing(self, state, batch):
        """The MoE layers' load balance (max expert share over the mean, averaged over
        layers) and share of slots dropped by a capacity, on ``batch``."""
        _, sown = self.model.apply(self._variables(state), batch[:, :-1], mutable=["moe_stats"])
        loads = [a for path, a in jax.tree.leaves_with_path(sown) if "expert_load" in str(path)]
        dropped = [a for path, a in jax.tree.leaves_with_path(sown) if "dropped" in str(path)]
        load = jnp.concatenate([a.reshape(-1, a.shape[-1]) for a in loads])  # [moe layers, e]
        balance = jnp.mean(load.shape[-1] * jnp.max(load, axis=-1))
        return balance, jnp.mean(jnp.concatenate([d.reshape(-1) for d in dropped]))

    def sharding_context(self):
        """Trace and run the steps inside this: under a mesh, the activation constraints."""
        return mesh_lib.sharding_context(self.mesh)

    def put(self, batch: np.ndarray):
        """The global batch array from this process's rows of it (:attr:`rows`)."""
        if self.batch_sharding is None:
            return jnp.asarray(batch)
        shape = (self.config.batch_size, *batch.shape[1:])
        return jax.make_array_from_process_local_data(self.batch_sharding, batch, shape)
