"""What cogattn knows of one model family: a :class:`ModelSpec` (docs/design.md, "The model seam").

A family module (``cogvideox.py``, ``wan.py``, ``hunyuan_video.py``) holds everything family-specific and
registers one spec; the rest of cogattn sees a `TokenLayout`, q and k, and the spec's answers. The
capture sites of a transformer are its attention modules in execution order, across block lists
(HunyuanVideo: ``transformer_blocks`` 0–19, then ``single_transformer_blocks`` as layers 20–59), each with
a stable name such as ``"single_transformer_blocks.12.attn"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..exact.passes import GROUP_MASK_COST
from ..exact.reducers import REDUCERS  # every kind is registered once cogattn is imported
from ..exact.reducers.audio import AUDIO_KINDS
from .site import Site, module_at

__all__ = ["ModelSpec", "Site", "StepTime", "Unavailable", "call_argument", "text_never_queries"]


class Unavailable(ImportError):
    """Raised by a family's module where the installed diffusers lacks its attention modules: the registry
    then lists the family in ``UNAVAILABLE`` with what it needs.

    Args:
        family (`str`): the family's name.
        needs (`str`): what it needs, as a user reads it (``"Wan needs diffusers >= 0.35 (WanAttention)"``).
        known (`dict[str, dict]`): its released checkpoints' configs (their hub ids then say what it needs).
    """

    def __init__(self, family: str, needs: str, known: dict | None = None):
        super().__init__(needs)
        self.family, self.needs = family, needs
        self.known = dict(known or {})

    def __str__(self) -> str:
        return self.needs


class StepTime(float):
    """The timestep of a call that gives one per frame or per token (diffusion forcing, Wan 2.2 TI2V-5B): as
    a number, the largest (the step's); it keeps them all, so that two steps whose largest agree (SkyReels-V2's
    asynchronous diffusion forcing holds its last frames at 999 for several steps) are still told apart.

    Args:
        values (`torch.Tensor`): the call's timesteps, any shape.
    """

    values: torch.Tensor

    def __new__(cls, values: torch.Tensor):
        values = values.detach().to("cpu", torch.float64).flatten()
        time = super().__new__(cls, float(values.max()))
        time.values = values
        return time

    def same_step(self, other: float) -> bool:
        """Whether a call at ``other`` belongs to the step of a call at this time."""
        if isinstance(other, StepTime) and other.values.shape == self.values.shape:
            return torch.equal(self.values, other.values)
        return float(self) == float(other)


def call_argument(args: tuple, kwargs: dict, index: int, name: str):
    """Argument ``name`` (forward position ``index``) of a transformer call, `None` when not given (``read_call``)."""
    return kwargs[name] if name in kwargs else args[index] if index < len(args) else None


def text_never_queries(title: str) -> str:
    """Why there is no ``text_to_video`` where the text is only a cross-attention's key (Wan): ``refused``'s entry."""
    return (
        f"{title}'s text never queries (its self-attention is over the video alone; the text is a key of the "
        "cross-attention), so there are no text → video probabilities. Use 'video_to_text'."
    )


@dataclass(frozen=True)
class ModelSpec:
    """One model family's facts.

    Args:
        family (`str`): its name in run metadata (``"cogvideox"``, ``"wan"``, ``"hunyuan_video"``).
        transformers (`tuple[type, ...]`): transformer classes of the family (diffusers' copies of a model
            under another name included); a module is the family's when it is an instance of one.
        sites (`tuple[Site, ...]`): the block lists, in execution order.
        processors (`dict[type, type]`): stock processor class → the cogattn processor copying it.
        read_call (`Callable`): ``(config, args, kwargs)`` of a transformer call → ``(TokenLayout, batch
            size, timestep, device)``; the timestep a `float`, or a `StepTime` where the call gives one per
            frame or token.
        layout_for_video (`Callable`): ``(config, num_frames, height, width, text_len)`` → the
            `TokenLayout` of a pipeline call.
        tiny_pipeline (`Callable`): ``(task="text-to-video", *, dtype, seed, ...)`` → a tiny random pipeline of
            the family (tests, the notebook, the batch tool's ``tiny-<family>`` model).
        tiny_transformer (`Callable`): ``(...)`` → the tiny pipeline's transformer alone.
        tiny_call (`Callable | None`): ``(pipe, task, generator, guided)`` → the arguments of a call of the tiny
            pipeline for one video of random text embeddings (the self-test's), guided or not.
        tiny_tasks (`tuple[str, ...]`): the tasks the tiny pipeline takes.
        config_keys (`tuple[str, ...]`): config keys only this family has (a config without ``_class_name``).
        known (`dict[str, dict]`): the released checkpoints' transformer configs (the attention shapes),
            for plans made offline.
        text_len (`int`): the text tokens of a pipeline call (its ``max_sequence_length`` default).
        context_kinds (`dict[str, str]`): kinds made by an attention other than the self-attention → its source
            (``"text"``, ``"image"``, or a ``Site.others`` source); a family without ``"audio"`` refuses the audio kinds.
        refused (`dict[str, str]`): kinds the family has no attention for → why.
        experts (`tuple[str, ...]`): pipeline attributes holding transformers that take turns by step.
        guidance_calls (`int`): transformer calls per step under classifier-free guidance (1: the batch
            ``[uncond..., cond...]`` in one call; 2: the conditional call, then the unconditional one).
        guidance (`Callable | None`): ``pipeline`` → whether classifier-free guidance is on in its running
            call (`None`: unknown); defaults to its ``guidance_scale > 1``.
        guidance_argument (`str`): the pipeline call's argument that turns guidance on (``estimate`` takes it).
        output_call (`bool`): whether ``layer_output="lse"`` / ``"joint"`` can make the output call (not when
            the attention takes a mask).
        title (`str`): its name in messages (``"CogVideoX"``, ``"Wan"``, ``"HunyuanVideo"``); left out: the first
            transformer class's name without ``Transformer3DModel``.
        frame_counts (`str`): frame counts its checkpoints run at, for messages (``"9, 13, ..., 49, ..., 81"``).
        pipelines (`dict[str, str]`): task → the diffusers pipeline class the batch tool loads a checkpoint
            with (:meth:`load_pipeline`; other tasks are refused); left out: diffusers' names,
            ``<title>Pipeline`` and ``<title>ImageToVideoPipeline``, for the ``tiny_tasks``. A modular pipeline
            (MiniMax-H3's) loads its components for the task's workflow (``workflows``: task → its name, ``"t2va"``).
        float32 (`tuple[str, ...]`): pipeline components :meth:`load_pipeline` keeps in float32 (Wan's VAE).
        call_rules (`Callable | None`): ``(cfg, config)`` → raises `ValueError` (one line) where a batch tool config
            ``cfg`` breaks a rule of the family's call for a transformer with ``config``, beyond the common ones
            (the VAE's frame counts, whole patches, the tasks of ``pipelines``, ``guidance_scale_2`` for two experts).
        tiny_name (`str`): the batch tool's ``model:`` name of the tiny pipeline; left out: ``"tiny-<family>"``.
        tiny_options (`dict[str, tuple[str, tuple, str]]`): batch tool config keys of the tiny pipeline →
            ``(its tiny_pipeline keyword, the choices, the first the default, what it sets)``; a keyword
            ``experts`` sets the number of expert transformers.
        tiny_prompt_arguments (`dict`): call arguments the tiny pipeline needs with a text prompt (HunyuanVideo's).
        empty_negative (`bool`): whether the batch tool passes an empty negative prompt under guidance (EasyAnimate).
        prompt_text (`Callable | None`): ``(pipeline, prompt, length, template, offsets)`` → the
            `cogattn.models.prompt_text.PromptText` of the ``length`` text tokens the transformer reads for ``prompt``, as
            the family's pipeline makes them (its template and crop; ``template`` is the call's
            ``prompt_template``, `None` for the pipeline's default; ``offsets``: with character offsets);
            left out: the tokenizer on the prompt alone (``cogattn.models.prompt_text.pipeline_text``).
        batch_refusal (`str | Callable`): why the batch tool plans (``--dry-run``) but does not run the family's
            checkpoints (Wan Animate: its call needs videos a prompts file does not give), or ``config`` → why for
            a checkpoint with that transformer config (Cosmos: the 2.5 ones alone); empty: it runs them.
        window (`Callable | None`): ``pipeline`` → ``(index, count)`` of the window running in its call, where the
            pipeline makes a long video in windows, each a denoising loop (SkyReels-V2); `None` outside such a call.
        call_steps (`Callable | None`): ``(num_frames, num_inference_steps)`` → the steps a pipeline call makes, for
            plans (Helios: a loop per chunk; MiniMax-H3: one fewer, its grid's last point); left out: the steps.
        extra_call (`Callable | None`): ``(args, kwargs)`` of a transformer call → what perturbs the model in it
            (LTX-2's spatio-temporal guidance and modality-isolation calls, made after each step's guidance call), or
            `None` for a call of the model itself; a perturbed call is left out, as a guider's.
        uncaptured (`dict[str, str]`): block attributes of attentions that name no layer → what each is, for the
            refusal of a layer name that names one (LTX-2's audio attentions, recorded under the block's layer).
        head_shape (`Callable | None`): ``config`` → ``(heads, head dim)`` of the captured attention, where the config
            names them otherwise (Kandinsky 5's ``model_dim``); left out: ``num_attention_heads``, ``attention_head_dim``.
        source_shapes (`Callable | None`): ``config`` → source → ``(heads, head dim)`` where not the self-attention's.
        glyph_text (`Callable | None`): ``(pipeline, prompt, length, offsets)`` → the `PromptText` of the ``length``
            tokens of a second encoder that the model packs as the text's ``glyph`` part (HunyuanVideo 1.5: the
            ByT5 bytes of the prompt's quoted words, named by ``pipeline.tokenizer_2``); `None`: no such part.
        text_spans (`Callable | None`): ``(config, args, kwargs)`` of a transformer call → per item of its batch,
            where each part of the text sits on the text tokens, ``{"image": (start, end), "glyph": ..., "prompt":
            ...}``, for a family that packs its text per item (HunyuanVideo 1.5; ``TokenLayout.text_parts``);
            `None`: every item's text is the layout's (``TokenLayout.spans``).
        interleaved (`bool`): block i of every site runs before block i + 1 of any (Latte's spatial, temporal blocks).
        negative_template (`list | dict | None`): the template its pipeline puts the negative prompt in, where not the
            prompt's (``prompt_text``'s ``template``; SANA-Video: none, ``[]``); `None`: the prompt's.
        group_masked (`Callable | None`): ``config`` → whether its self-attention runs under a per-head mask over token
            groups (Latte, Cosmos 3, Kandinsky 5's NABLA), which row tiles apply: plans made offline take them.
    """

    family: str
    transformers: tuple[type, ...]
    sites: tuple[Site, ...]
    processors: dict[type, type]
    read_call: Callable
    layout_for_video: Callable
    tiny_pipeline: Callable
    tiny_transformer: Callable
    tiny_call: Callable | None = None
    tiny_tasks: tuple[str, ...] = ("text-to-video",)
    config_keys: tuple[str, ...] = ()
    known: dict[str, dict] = field(default_factory=dict)
    text_len: int = 226
    context_kinds: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    experts: tuple[str, ...] = ("transformer",)
    guidance_calls: int = 1
    guidance: Callable | None = None
    guidance_argument: str = "guidance_scale"
    output_call: bool = True
    title: str = ""
    frame_counts: str = "9, 13, ..., 81, ..., 121"
    pipelines: dict[str, str] = field(default_factory=dict)
    workflows: dict[str, str] = field(default_factory=dict)
    float32: tuple[str, ...] = ()
    call_rules: Callable | None = None
    tiny_name: str = ""
    tiny_options: dict[str, tuple[str, tuple, str]] = field(default_factory=dict)
    tiny_prompt_arguments: dict = field(default_factory=dict)
    empty_negative: bool = False
    batch_refusal: str | Callable = ""
    prompt_text: Callable | None = None
    window: Callable | None = None
    call_steps: Callable | None = None
    extra_call: Callable | None = None
    uncaptured: dict[str, str] = field(default_factory=dict)
    head_shape: Callable | None = None
    source_shapes: Callable | None = None
    glyph_text: Callable | None = None
    text_spans: Callable | None = None
    interleaved: bool = False
    negative_template: list | dict | None = None
    group_masked: Callable | None = None

    def __post_init__(self):
        if not self.title:
            object.__setattr__(self, "title", self.transformers[0].__name__.removesuffix("Transformer3DModel"))
        if not self.tiny_name:
            object.__setattr__(self, "tiny_name", "tiny-" + self.family.replace("_", "-"))
        if not self.pipelines:
            named = {"text-to-video": "Pipeline", "image-to-video": "ImageToVideoPipeline"}
            pipelines = {task: self.title + named[task] for task in self.tiny_tasks if task in named}
            object.__setattr__(self, "pipelines", pipelines)
        if "audio" not in self.context_kinds.values():  # one line for every family without an audio stream
            no_audio = dict.fromkeys(AUDIO_KINDS, f"{self.title} has no audio stream (the audio kinds are LTX-2's).")
            object.__setattr__(self, "refused", {**no_audio, **self.refused})

    def guidance_on(self, pipeline) -> bool | None:
        """Whether classifier-free guidance is on in ``pipeline``'s running call; `None` without a pipeline."""
        if pipeline is None:
            return None
        if self.guidance is not None:
            return self.guidance(pipeline)
        try:
            scale = pipeline.guidance_scale
        except AttributeError:  # set by the pipeline's call; not there before it
            scale = None
        return bool(scale is not None and scale > 1)

    def attention_shape(self, config: dict) -> tuple[int, int]:
        """``(heads, head dim)`` of the captured attention of a transformer with ``config``."""
        if self.head_shape is not None:
            return self.head_shape(config)
        return int(config["num_attention_heads"]), int(config["attention_head_dim"])

    def module_shape(self, transformer) -> tuple[int, int]:
        """``(heads, head dim)`` of ``transformer``'s captured attention modules (the first one's)."""
        if self.head_shape is not None:
            return self.head_shape(transformer.config)
        module = self.attention_modules(transformer)[0]
        return module.heads, module.inner_dim // module.heads

    def matches(self, module) -> bool:
        """Whether ``module`` is a transformer of this family."""
        return isinstance(module, self.transformers)

    def matches_config(self, config: dict) -> bool:
        """Whether a transformer config is this family's (its ``_class_name``, else keys only it has)."""
        if (name := config.get("_class_name")) is not None:
            return name in {cls.__name__ for cls in self.transformers}
        return any(key in config for key in self.config_keys)

    def kinds(self, source: str | None = None) -> tuple[str, ...]:
        """The kinds this family makes (of one ``source``: ``"self"``, ``"text"``, ...), in ``cogattn.KINDS`` order."""
        made = [k for k in REDUCERS if k not in self.refused]
        return tuple(k for k in made if source is None or self.source(k) == source)

    def source(self, kind: str) -> str:
        """Which attention makes ``kind``: ``"self"``, or another's source (``"text"``, ``"image"``, ``"audio"``)."""
        return self.context_kinds.get(kind, "self")

    def shapes(self, config: dict) -> dict[str, tuple[int, int]]:
        """Source → ``(heads, head dim)`` of the attentions whose heads are not the self-attention's."""
        return {} if self.source_shapes is None else dict(self.source_shapes(config))

    def check_kinds(self, kinds) -> None:
        """Raise `ValueError` for a kind this family has no attention for."""
        for kind in kinds:
            if kind in self.refused:
                raise ValueError(f"kind {kind!r} does not exist for {self.family}: {self.refused[kind]}")

    def _in_order(self, of) -> list[tuple[Site, int, object]]:
        """``(site, index in its list, block)`` of every layer of a transformer in execution order (a config: no block)."""
        config = of if isinstance(of, dict) else of.config
        lists = [[None] * s.count(of) if isinstance(of, dict) else s.members(of) for s in self.sites]
        order = sorted((i * self.interleaved, s, i) for s, blocks in enumerate(lists) for i in range(len(blocks)))
        return [(self.sites[s], self.sites[s].first(config) + i, lists[s][i]) for _, s, i in order]

    def layer_layouts(self, config: dict, layout) -> dict:
        """Layer → its own `TokenLayout` from the generation's ``layout``, where it is another (``Site.layout``)."""
        return {n: site.layout(layout) for n, (site, _, _) in enumerate(self._in_order(config)) if site.layout}

    def layer_names_for_config(self, config: dict) -> tuple[str, ...]:
        """The layer names of a transformer with ``config`` (no module needed: plans made offline)."""
        return tuple(f"{site.blocks}.{i}.{site.attention}" for site, i, _ in self._in_order(config))

    def source_layers(self, config: dict, source: str) -> tuple[int, ...]:
        """The layers of a transformer with ``config`` that have the attention of ``source`` (``"text"``: Latte's
        spatial blocks alone, Motif-Video's blocks where its config enables the cross-attention)."""
        others = {s for site in self.sites for s, _ in site.others}  # a source of its own attention (LTX-2's audio)
        return tuple(
            layer
            for layer, (site, _, _) in enumerate(self._in_order(config))
            if source in {s for s, _ in site.others} or (source not in others and site.has_context(config))
        )

    def mask_cost(self, config: dict) -> tuple[int, int]:
        """What the mask its self-attention runs under holds per score of a row tile (``passes.mask_cost``)."""
        return GROUP_MASK_COST if self.group_masked is not None and self.group_masked(config) else (0, 0)

    def num_layers(self, config: dict) -> int:
        """The number of layers (capture sites) of a transformer with ``config``."""
        return sum(site.count(config) for site in self.sites)

    def check_options(self, options, config: dict | None = None) -> None:
        """Raise `ValueError` for options the family cannot serve (an output call it cannot make, a bad layer name)."""
        for name in options.layers if isinstance(options.layers, tuple) else ():
            listed, number, path = ([*name.split(".", 2), "", ""] if isinstance(name, str) else ["", "", ""])[:3]
            if path in self.uncaptured and number.isdigit() and any(listed == site.blocks for site in self.sites):
                raise ValueError(f"layers: {name!r} is {self.title}'s {self.uncaptured[path]}")
        if options.layer_output != "stock" and not self.output_call:
            raise ValueError(
                f"layer_output={options.layer_output!r} makes the layer's output call itself, without a mask; "
                f"{self.family}'s attention takes a key mask (padded text), so its layers keep the stock call: "
                "use layer_output='stock' (capture is exact either way)."
            )

    def layers(self, transformer) -> list[tuple[str, object, object | None]]:
        """``(name, self-attention, cross-attention or None)`` of every layer, in execution order; a
        layer's name is its self-attention's path in the transformer (``"transformer_blocks.3.attn1"``)."""
        return [
            (f"{s.blocks}.{i}.{s.attention}", module_at(b, s.attention), module_at(b, s.context) if s.context else None)
            for s, i, b in self._in_order(transformer)
        ]

    def layer_names(self, transformer) -> tuple[str, ...]:
        """The stable name of every layer, in execution order (``layers=`` takes them too)."""
        return tuple(name for name, _, _ in self.layers(transformer))

    def attention_modules(self, transformer) -> list:
        """The self-attention module of every layer."""
        return [attn for _, attn, _ in self.layers(transformer)]

    def roles(self, transformer) -> dict[int, tuple[int, str]]:
        """``id(module)`` → ``(layer, "self" or "context")`` for every attention module captured (a site's
        ``others`` are ``"context"``: each hands its maps on with its source)."""
        out = {}
        for layer, (site, _, block) in enumerate(self._in_order(transformer)):
            out[id(module_at(block, site.attention))] = (layer, "context" if site.attention == site.context else "self")
            for attr in [site.context] * bool(site.context) + [a for _, a in site.others]:
                if module_at(block, attr) is not None:  # a block without it (Motif-Video's optional cross-attention)
                    out[id(module_at(block, attr))] = (layer, "context")
        return out

    def site_modules(self, transformer, sources: bool = False) -> dict[str, object]:
        """Every captured attention module (self- and cross-attention, ``others``) by its path in the transformer;
        with ``sources``: ``(module, source)``, the source `None` but for a site's ``others``."""
        out = {}
        for site, i, block in self._in_order(transformer):
            for source, attr in [(None, site.attention), (None, site.context), *site.others]:
                if attr is not None and (module := module_at(block, attr)) is not None:
                    out[f"{site.blocks}.{i}.{attr}"] = (module, source) if sources else module
        return out

    def map_processors(self, transformer, sink) -> dict[str, object]:
        """cogattn processors feeding ``sink`` for every captured attention module, by its path; refuses
        processors that are not stock."""
        replacement = {}
        for name, (module, source) in self.site_modules(transformer, sources=True).items():
            proc = module.processor
            if isinstance(proc, tuple(self.processors.values())):
                raise ValueError(f"{name} already runs a cogattn processor; close the other recording first.")
            if type(proc) not in self.processors:
                stock = list(dict.fromkeys(cls.__name__ for cls in self.processors))
                raise TypeError(
                    f"{name} runs a {type(proc).__name__}; cogattn captures through the stock {' or '.join(stock)}. "
                    f"Reset with `transformer.set_attn_processor({stock[0]}())`."
                )
            replacement[name] = self.processors[type(proc)](*(sink, source)[: 1 + (source is not None)])
            for attr in ("_attention_backend", "_parallel_config"):  # set_attention_backend(...) and the like
                if hasattr(proc, attr):
                    setattr(replacement[name], attr, getattr(proc, attr))
        return replacement

    # -- the batch tool (cogattn.dump) ---------------------------------------------------------------
    def refusal(self, config: dict) -> str:
        """Why the batch tool plans but does not run a checkpoint whose transformer has ``config``
        (``batch_refusal``); empty where it runs it."""
        return self.batch_refusal(config) if callable(self.batch_refusal) else self.batch_refusal

    def check_task(self, task: str, tiny: bool = False) -> None:
        """Raise `ValueError` where the batch tool cannot run ``task`` with this family's checkpoints
        (``pipelines``) or, with ``tiny``, its tiny pipeline (``tiny_tasks``)."""
        tasks = self.tiny_tasks if tiny else tuple(self.pipelines)
        if not tasks:
            no = f"the batch tool does not load {self.title} checkpoints yet (the family names no pipeline class)"
            raise ValueError(f"{no}; try its tiny pipeline, model: {self.tiny_name}.")
        if task not in tasks:
            which = f"{self.tiny_name} (the tiny {self.title} pipeline)" if tiny else f"{self.title} checkpoints"
            raise ValueError(f"task: {task!r}; the batch tool runs {which} for {' or '.join(tasks)} only.")

    def pixels_per_patch(self, config: dict) -> tuple[int, int]:
        """``(VAE pixels per latent pixel, patch size)`` of a transformer with ``config``, each way (a pipeline
        call's height and width are multiples of their product), read from ``layout_for_video``."""
        side = 4096  # a multiple of every VAE × patch size
        layout = self.layout_for_video(config, 1, side, side, 1)
        return side // layout.height // layout.patch_size, layout.patch_size

    def load_pipeline(self, model: str, task: str, dtype: torch.dtype):
        """The family's diffusers pipeline for ``task`` (``pipelines``) from a hub id or a local checkpoint
        folder, its weights in ``dtype`` but for the ``float32`` components."""
        import diffusers

        self.check_task(task)
        name = self.pipelines[task]
        if not hasattr(diffusers, name):
            raise ValueError(f"this diffusers has no {name} for {self.title} {task}; set the family's pipelines.")
        dtypes = {"default": dtype, **dict.fromkeys(self.float32, torch.float32)} if self.float32 else dtype
        if not issubclass(cls := getattr(diffusers, name), getattr(diffusers, "ModularPipeline", ())):  # ≥ 0.35
            return cls.from_pretrained(model, torch_dtype=dtypes)
        pipe = cls.from_pretrained(model, workflow=self.workflows.get(task))  # the task's components alone
        pipe.load_components(torch_dtype=dtypes)
        return pipe
