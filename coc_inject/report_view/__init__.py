"""``coc-inject report``: COC_REPORT files and COC_TRACE traces read back.

``load.py`` reads what the command is given (a COC_REPORT file, a trace file, a COC_TRACE
directory) and says clearly what is wrong with it; ``tables.py`` makes the communication table of a
report and the side-by-side of two (text, and its JSON twin); ``plot.py`` draws one step's
timeline per rank from traces (a PNG, with matplotlib); ``command.py`` is the command itself.
The per-layer route table is cli.py's, as it was.
"""
