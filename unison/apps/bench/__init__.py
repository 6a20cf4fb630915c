"""``unison bench``: which way of keeping replicas in agreement reaches a target quality fastest on a given network.

Modules: ``netem`` (emulated networks), ``workloads`` (what is trained),
``contenders`` (unison algorithms and the peers a user would pick instead),
``worker`` (one rank of one contender), ``runner`` (launches the ranks of each
contender), ``report`` (table, JSON, plots, recommendation), ``deps`` (what a
run needs installed, checked first), ``command`` (the command line).
"""
