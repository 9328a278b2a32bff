"""The per-collector text cache: unchanged families reuse their bytes, changed ones render anew."""

from prometheus_client.core import GaugeMetricFamily

from sidecar.collectors.base import TextCache, render_text


def gauge(name: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, "help", labels=["gpu"])
    g.add_metric(["0"], value)
    return g


def test_the_cached_text_equals_a_fresh_rendering_round_after_round():
    cache = TextCache()
    for values in [(1.0, 2.0), (1.0, 3.0), (4.0, 3.0), (4.0, float("nan"))]:
        families = [gauge("sidecar_a", values[0]), gauge("sidecar_b", values[1])]
        assert cache.render(families) == render_text(families)


def test_a_family_that_disappears_is_not_rendered_again():
    cache = TextCache()
    cache.render([gauge("sidecar_a", 1.0), gauge("sidecar_b", 2.0)])
    text = cache.render([gauge("sidecar_a", 1.0)])
    assert b"sidecar_b" not in text and b"sidecar_a" in text
