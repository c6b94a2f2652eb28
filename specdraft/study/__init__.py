"""The study: offline acceptance, draft quality, the sweep over drafts x k x batch x datasets, and
the report (see :mod:`specdraft.study.offline`, :mod:`specdraft.study.sweep`,
:mod:`specdraft.study.report`)."""
