"""Release messages: what leaves a device (format version 2, docs/FORMAT.md).

A release is a deterministic-CBOR map (pansketch.agent.cbor) of integers, text and
one byte string: the noisy counters as d*w little-endian int32 values. Its
size depends only on the parameters (d, w, ids), never on the data: the
counters are fixed-width and never compressed or varint-packed, and no
exact event count is included.
"""

from pansketch.agent import cbor, hashing

FORMAT_VERSION = 2  # v2 adds ``lvl`` (tree node level; 0 in window/keep mode). Hosts still read v1.


def release_map(params, seq, elo, ehi, part, counters, nz=2, lvl=0, inoise=None):
    """The release as a dict; ``counters`` is the noisy array('i') carrying
    ``nz`` independent noise draws per cell (nz - 1 internal at ``inoise``,
    default ``params.inoise``; 1 output at ``params.noise``).
    ``lvl`` is the tree level of the node [elo, ehi) (ehi - elo = 2**lvl)."""
    spec = params.noise
    ispec = inoise if inoise is not None else params.inoise
    m = {
        "v": FORMAT_VERSION,
        "dev": params.device,
        "seq": seq,
        "mode": params.mode,
        "kind": params.kind,
        "d": params.d,
        "w": params.w,
        "hv": hashing.HASH_VERSION,
        "salt": hashing.salt_id(params.salt),
        "clip": params.clip,
        "mech": params.mechanism,
        "budget": [params.budget[0], params.budget[1]],
        "nint": [ispec.num, ispec.den],
        "nout": [spec.num, spec.den],
        "nz": nz,
        "L": params.arrays,
        "lvl": lvl,
        "win_s": params.window_s,
        "ep_s": params.epoch_s,
        "win": (elo * params.epoch_s) // params.window_s,
        "elo": elo,
        "ehi": ehi,
        "part": part,
        "ctr": counters,
    }
    if params.kind == "dcs":  # the kind's own keys (docs/FORMAT.md); dbits has none
        m["b"] = params.b
        m["map"] = [params.map[0], params.map[1], params.map[2]]
    elif params.kind == "strhh":  # b = item bytes = levels (docs/FORMAT.md "Kind strhh")
        m["b"] = params.b
    return m


def encode_to(params, seq, elo, ehi, part, counters, write, nz=2, lvl=0, inoise=None):
    """Stream the encoded release through ``write`` (no full copy in RAM)."""
    cbor.encode_to(release_map(params, seq, elo, ehi, part, counters, nz, lvl, inoise), write)


def encode(params, seq, elo, ehi, part, counters, nz=2, lvl=0):
    return cbor.dumps(release_map(params, seq, elo, ehi, part, counters, nz, lvl))
