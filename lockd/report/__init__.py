"""``timeslice report``: the operator's page of the whole system, read from lockd's records in etcd.

``cli`` (the subcommand), ``page`` (the HTML page), ``figures`` (a run's figures: duty cycle,
swaps, overlaps; the demo uses them too) and ``timeline`` (the timeline picture).
"""
