"""``path("ops/outbox/", include("outbound.contrib.django.urls"))``: the status page and its
JSON, for active staff users (see :mod:`outbound.contrib.django.views`)."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "outbound"

urlpatterns = [
    path("", views.status_page, name="status"),
    path("status.json", views.status_json, name="status_json"),
]
