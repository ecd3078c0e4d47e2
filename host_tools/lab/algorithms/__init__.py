"""Library versions of every algorithm of the papers docs/REPRODUCTION.md cites (Zhao et al., Yildirim et al., Holland, Mir et al.).

Built on the device core: hashing version 1 (``pansketch.agent.hashing`` /
``pansketch.host_tools.fasthash``), the int32 counter layout of ``pansketch.agent.sketch`` and the
exact discrete samplers of ``pansketch.agent.noise`` (or their vectorised twins in
:mod:`pansketch.host_tools.lab.algorithms.vnoise`, which implement the same Canonne-Kamath-
Steinke algorithms with integer arithmetic and are tested against the pmf).

Modules, one per paper:

* :mod:`.linear`       -- dp-linear-sketches.txt (+ appendix): Private Count-Min
  / CountSketch (Alg. 3, Thms 3.1/3.2) and the Private Dyadic CountSketch (§4).
* :mod:`.intermittent` -- intermittent-queries-dp-count-sketch.txt Algs 1-4.
* :mod:`.continual`    -- lazy-sketch-continual-observation.txt Algs 1-5.
* :mod:`.panprivate`   -- pan-private-sketches.txt §4 (cropped sum, HH count);
  the distinct-count sketch of its Alg. 1 is :mod:`.distinct` (MicroPython subset, run on the VM by a test).

May import: agent, pansketch.host_tools.fasthash.
"""
