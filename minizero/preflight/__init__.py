"""The preflight: a cluster job's launch, checked in about 30 seconds before the job itself.

    torchrun <the job's flags> -m minizero.preflight <the job's training flags>
    python -m minizero.preflight torchrun <the job's whole line>      # also bounds torchrun's rendezvous

The first form is the job's own line with `minizero.train` replaced: the same ranks on the
same nodes, the same environment, the same config, save folder and data folder. Its ranks
answer, each as one line: did every rank join; which ranks share a host, asked of the hosts
themselves, and does that agree with the launcher (torchrun, srun) and with hpZ's k or HSDP's
S; do all-reduce, all-gather and reduce-scatter give the right numbers on the job's backend,
at what bandwidth inside a node and between nodes; is the save folder one folder on every
node, writable; is the data there on every node; is there disk space for the checkpoints of
this model. A failure is one line that names the cause and the setting that fixes it.

torchrun meets the other nodes (its rendezvous) before any rank starts, so a wrong
--rdzv-endpoint would leave the first form waiting in torchrun itself (10 minutes, then a
traceback). The second form runs the same line under a watch: it checks first that the
endpoint's name resolves and that something answers there, then runs the line with
`minizero.preflight` in place of the program, and ends in one line when the nodes have not
met within --timeout.

Files: `command.py` the command line and what it implies (the model's checkpoint size, the
node-group sizes), `rendezvous.py` everything before the process group exists (the endpoint,
the join through the rendezvous store, the watchdog), `checks.py` the checks once it does,
`ranks.py` the order a rank runs them in and the report, `launch.py` the second form.
docs/operations.md says what each line means.
"""
