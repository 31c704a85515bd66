"""Per step: the update-free graph of the step's width, or the graph updated per layer.

An update-free graph spends no host time on updates and reads ``width`` keys of every request
(plus a mask byte each); the updated graph reads only each request's own keys and pays a
per-layer update on the host.  Where the host is the bound (few requests, short contexts,
small layers), the update-free graph wins; where the device is (long contexts under a wide
width, large batches), reading the whole width costs more than the update it saves.
:class:`UpdateFreeCosts` weighs the two for a step, from four figures a deployment
calibrates or measures (``npugraph bench`` models them on A2's costs).
"""

from __future__ import annotations

import attrs

__all__ = ["UpdateFreeCosts", "default_widths"]


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:  # NaN too
        raise ValueError(f"UpdateFreeCosts.{attribute.name} must be >= 0 (microseconds), got {value!r}")


@attrs.frozen(kw_only=True)
class UpdateFreeCosts:
    """A step's modeled time either way: the longer of the host's time and the device's.

    * ``updated_host_us``: host time of a step updated per layer (every layer's re-issue and
      event record, and the replay's launch);
    * ``update_free_host_us``: host time of an update-free step (the length copy, the mask's
      comparison, one event record, the replay's launch);
    * ``device_other_us``: device time of a step's work besides attention (every layer);
    * ``attention_us_per_key``: device time of attention per key read (every layer);
    * ``mask_bytes_per_key``: what the mask adds to a key read, as a share of the key's own
      bytes (a bool over a key and a value of, say, 128 fp16 values: 1/512).
    """

    updated_host_us: float = attrs.field(validator=_non_negative)
    update_free_host_us: float = attrs.field(validator=_non_negative)
    device_other_us: float = attrs.field(validator=_non_negative)
    attention_us_per_key: float = attrs.field(validator=_non_negative)
    mask_bytes_per_key: float = attrs.field(default=0.0, validator=_non_negative)

    def updated_us(self, keys: int) -> float:
        """A step updated per layer whose requests hold ``keys`` keys in all."""
        return max(self.updated_host_us, self.device_other_us + self.attention_us_per_key * keys)

    def update_free_us(self, width: int, rows: int) -> float:
        """A step of an update-free graph of ``rows`` request rows, each read to ``width`` keys."""
        read = self.attention_us_per_key * (1.0 + self.mask_bytes_per_key) * width * rows
        return max(self.update_free_host_us, self.device_other_us + read)

    def prefers_update_free(self, width: int, rows: int, keys: int) -> bool:
        """Whether the update-free graph of ``width`` runs the step at least as fast."""
        return self.update_free_us(width, rows) <= self.updated_us(keys)

    def why(self, width: int, rows: int, keys: int) -> str:
        """The choice for a step, and why, in one line."""
        free, upd = self.update_free_us(width, rows), self.updated_us(keys)
        pick = "update-free" if free <= upd else "updated per layer"
        return (
            f"{pick}: update-free at width {width} models {free:.0f} us a step (reads {width * rows} keys), "
            f"updated {upd:.0f} us (reads {keys} keys, {self.updated_host_us:.0f} us of host update)"
        )


def default_widths(block_size: int, max_model_len: int) -> tuple[int, ...]:
    """The width ladder a size's update-free graphs take by default: powers of two from the
    block size up to ``max_model_len`` (the last whole blocks within it), so a step reads at
    most twice its longest request's keys; a longer step runs the updated graph."""
    if block_size < 1 or max_model_len < block_size:
        return ()
    widths, w = [], block_size
    while w < max_model_len:
        widths.append(w)
        w *= 2
    top = max_model_len // block_size * block_size
    if not widths or widths[-1] != top:
        widths.append(top)
    return tuple(widths)
