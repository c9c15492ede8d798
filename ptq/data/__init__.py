"""Where samples come from: image files and their preprocessing (`images`), `--data` array files (`samples`),
sources of the reports and the tuner (`image_source`), labels read from file names (`labels`), label-free views
of a photo (`views`), and the log of what was read or skipped (`image_log`)."""
