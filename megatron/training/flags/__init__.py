"""Every command-line flag of the trainer -- all of upstream Megatron-LM's, plus this tree's
own -- declared once, by upstream's groups, as typed dataclasses: ``schema`` says how a field
becomes a flag, ``groups`` lists the groups in ``--help`` order."""
