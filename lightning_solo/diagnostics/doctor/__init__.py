"""TrainingDoctor: one rank's time split, the verdict (pure), the report, the chart, and the callback."""
