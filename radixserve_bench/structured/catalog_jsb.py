"""Schemas of JSONSchemaBench's kinds, written for this bench (none is copied from its data): GitHub
configuration and payload files (trivial to ultra), Kubernetes objects, Snowplow events, Washington
Post content (ANS), GlaiveAI function-call arguments and JSONSchemaStore tool configs. They keep
what makes those datasets hard: $defs/$ref, anyOf unions of objects, consts as discriminators, label
maps, patterns for names, ports, quantities and URIs, and unbounded strings where the originals
have them.
"""

from __future__ import annotations

from radixserve_bench.structured.schemas import BenchSchema, arr, b, e, i, n, obj, s, string_map

_DNS = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|Mi|Gi|Ki)?$"
_LABELS = {"type": "object", "additionalProperties": s(30), "maxProperties": 3}


def _k8s(kind: str, api: str, spec: dict, task: str) -> BenchSchema:
    """A Kubernetes object: apiVersion and kind fixed, metadata with a DNS name and labels."""
    meta = obj({"name": s(40, pattern=_DNS), "namespace": s(30, pattern=_DNS), "labels": _LABELS}, ("name",))
    return BenchSchema(f"k8s-{kind.lower()}", "kubernetes", task,
                       obj({"apiVersion": {"const": api}, "kind": {"const": kind}, "metadata": meta, "spec": spec}))


_CONTAINER = obj({
    "name": s(30, pattern=_DNS), "image": s(60, pattern=r"^[a-z0-9./-]+(:[a-zA-Z0-9._-]+)?$"),
    "ports": arr(obj({"containerPort": i(1, 65535), "protocol": e("TCP", "UDP")}, ("containerPort",)), 0, 2),
    "resources": obj({"limits": obj({"cpu": s(8, pattern=_QUANTITY), "memory": s(8, pattern=_QUANTITY)}, ())}, ()),
}, ("name", "image"))

_ANS_TEXT = obj({"type": {"const": "text"}, "content": s(120)})
_ANS_IMAGE = obj({"type": {"const": "image"}, "url": s(80, pattern=r"^https://"), "caption": s(60)}, ("type", "url"))

JSB_SCHEMAS: list[BenchSchema] = [
    # -- GitHub (trivial -> ultra) ---------------------------------------------------------------
    BenchSchema("gh-package-min", "github", "Write the package.json of a tiny private library.",
                {"type": "object", "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                                  "private": {"type": "boolean"}}, "required": ["name"]}),
    BenchSchema("gh-eslintrc", "github", "Write an ESLint configuration for a browser project.",
                obj({"root": b(), "env": obj({"browser": b(), "node": b(), "es2022": b()}, ()),
                     "rules": {"type": "object", "additionalProperties": e("off", "warn", "error"), "maxProperties": 4}},
                    ("env", "rules"))),
    BenchSchema("gh-compose-service", "github", "Describe a docker compose service running a web server.",
                obj({"image": s(40), "ports": arr(s(11, pattern=r"^[0-9]{2,5}:[0-9]{2,5}$"), 0, 3),
                     "environment": {"type": "object", "additionalProperties": s(30), "maxProperties": 3},
                     "restart": e("no", "always", "on-failure", "unless-stopped")}, ("image",))),
    BenchSchema("gh-issue-event", "github", "Write the webhook payload of a newly opened GitHub issue.",
                obj({"action": e("opened", "edited", "closed", "reopened"),
                     "issue": obj({"number": i(1), "title": s(80), "state": e("open", "closed"),
                                   "labels": arr(obj({"name": s(20), "color": s(6, pattern=r"^[0-9a-f]{6}$")}), 0, 3)}),
                     "sender": obj({"login": s(39, pattern=r"^[A-Za-z0-9-]+$"), "id": i(1)})})),
    BenchSchema("gh-workflow", "github", "Write a CI workflow that runs the tests on every push.",
                obj({"name": s(40), "on": arr(e("push", "pull_request", "workflow_dispatch"), 1, 3),
                     "jobs": obj({"test": obj({
                         "runs-on": e("ubuntu-latest", "macos-latest", "windows-latest"),
                         "steps": arr({"anyOf": [obj({"uses": s(50, pattern=r"^[a-z0-9-]+/[a-z0-9-]+@v[0-9]+$")}),
                                                 obj({"name": s(30), "run": s(80)}, ("run",))]}, 1, 4)})})})),
    BenchSchema("gh-tsconfig", "github", "Write a tsconfig.json for a strict Node library.",
                obj({"compilerOptions": obj({
                    "target": e("ES2019", "ES2020", "ES2022", "ESNext"), "module": e("commonjs", "esnext", "nodenext"),
                    "strict": b(), "outDir": s(20), "lib": arr(e("ES2022", "DOM", "DOM.Iterable"), 0, 3),
                    "declaration": b()}, ("target", "module")), "include": arr(s(20), 0, 3)}, ("compilerOptions",))),
    BenchSchema("gh-json-patch", "github", "Write a JSON Patch that renames a user and removes their phone.",
                arr({"oneOf": [obj({"op": {"const": "add"}, "path": s(40, pattern=r"^(/[a-z0-9_]+)+$"), "value": s(40)}),
                               obj({"op": {"const": "remove"}, "path": s(40, pattern=r"^(/[a-z0-9_]+)+$")}),
                               obj({"op": {"const": "replace"}, "path": s(40, pattern=r"^(/[a-z0-9_]+)+$"),
                                    "value": s(40)})]}, 1, 3)),
    BenchSchema("gh-openapi-op", "github", "Describe the API operation that fetches one pet by id.",
                {"$defs": {"param": obj({"name": s(20), "in": e("path", "query", "header"), "required": b(),
                                         "schema": obj({"type": e("string", "integer", "boolean")})}, ("name", "in")),
                           "response": obj({"description": s(60), "content_type": e("application/json", "text/plain")},
                                           ("description",))},
                 **obj({"operationId": s(30, pattern=r"^[a-zA-Z][a-zA-Z0-9]*$"), "summary": s(60),
                        "parameters": arr({"$ref": "#/$defs/param"}, 0, 3),
                        "responses": obj({"200": {"$ref": "#/$defs/response"}, "404": {"$ref": "#/$defs/response"}}, ("200",))},
                       ("operationId", "responses"))}),
    BenchSchema("gh-vega-lite", "github", "Write a bar chart specification of sales per month.",
                {"$defs": {"channel": obj({"field": s(20), "type": e("quantitative", "nominal", "ordinal", "temporal"),
                                           "aggregate": e("sum", "mean", "count")}, ("field", "type"))},
                 **obj({"$schema": {"const": "https://vega.github.io/schema/vega-lite/v5.json"},
                        "mark": {"anyOf": [e("bar", "line", "point"), obj({"type": e("bar", "line", "point"), "tooltip": b()})]},
                        "encoding": obj({"x": {"$ref": "#/$defs/channel"}, "y": {"$ref": "#/$defs/channel"},
                                         "color": {"$ref": "#/$defs/channel"}}, ("x", "y")),
                        "width": i(50, 2000)}, ("mark", "encoding"))}),
    # -- Kubernetes --------------------------------------------------------------------------------
    _k8s("Deployment", "apps/v1", obj({
        "replicas": i(0, 50), "selector": obj({"matchLabels": _LABELS}),
        "template": obj({"metadata": obj({"labels": _LABELS}), "spec": obj({"containers": arr(_CONTAINER, 1, 2)})})}),
        "Write a Deployment running two replicas of an nginx web server."),
    _k8s("Service", "v1", obj({
        "type": e("ClusterIP", "NodePort", "LoadBalancer"), "selector": _LABELS,
        "ports": arr(obj({"port": i(1, 65535), "targetPort": {"anyOf": [i(1, 65535), s(15, pattern=_DNS)]},
                          "protocol": e("TCP", "UDP")}, ("port",)), 1, 2)}, ("ports",)),
        "Write a Service exposing a web app on port 80."),
    _k8s("ConfigMap", "v1", {"type": "object", "additionalProperties": s(60), "maxProperties": 4},
         "Write a ConfigMap holding a log level and a feature flag."),
    _k8s("HorizontalPodAutoscaler", "autoscaling/v2", obj({
        "scaleTargetRef": obj({"kind": e("Deployment", "StatefulSet"), "name": s(40, pattern=_DNS)}),
        "minReplicas": i(1, 100), "maxReplicas": i(1, 1000),
        "metrics": arr(obj({"type": {"const": "Resource"}, "resource": obj({
            "name": e("cpu", "memory"), "target": obj({"type": {"const": "Utilization"}, "averageUtilization": i(1, 100)})})}),
            1, 2)}, ("scaleTargetRef", "maxReplicas")),
        "Write an autoscaler keeping CPU use of a web deployment at 70%."),
    _k8s("CronJob", "batch/v1", obj({
        "schedule": s(30, pattern=r"^[0-9*/,-]+( [0-9*/,-]+){4}$"), "concurrencyPolicy": e("Allow", "Forbid", "Replace"),
        "jobTemplate": obj({"spec": obj({"template": obj({"spec": obj({
            "containers": arr(_CONTAINER, 1, 1), "restartPolicy": e("OnFailure", "Never")})})})})},
        ("schedule", "jobTemplate")),
        "Write a CronJob that runs a backup every night at 2am."),
    # -- Snowplow ----------------------------------------------------------------------------------
    BenchSchema("snowplow-ad-click", "snowplow", "Record an ad click event.",
                obj({"clickId": s(36), "impressionId": s(36), "zoneId": s(36), "bannerId": s(36), "campaignId": s(36),
                     "advertiserId": s(36), "targetUrl": s(120, pattern=r"^https?://"), "costModel": e("cpa", "cpc", "cpm"),
                     "cost": n(0, 10000)}, ("targetUrl",))),
    BenchSchema("snowplow-self-describing", "snowplow", "Write a self-describing event for a link click.",
                obj({"schema": s(80, pattern=r"^iglu:[a-z.]+/[a-z_]+/jsonschema/[0-9]+-[0-9]+-[0-9]+$"),
                     "data": obj({"targetUrl": s(120), "elementId": s(40), "elementClasses": arr(s(20), 0, 3)},
                                 ("targetUrl",))})),
    BenchSchema("snowplow-screen-view", "snowplow", "Record a mobile app screen view.",
                obj({"name": s(40), "id": {"type": "string", "format": "uuid"},
                     "type": s(20), "previousName": {"type": ["string", "null"], "maxLength": 40},
                     "transitionType": e("push", "pop", "modal", None)}, ("name", "id"))),
    # -- Washington Post (ANS) -------------------------------------------------------------------
    BenchSchema("wapo-story", "washington-post", "Write the content record of a short news story.",
                obj({"type": {"const": "story"}, "version": s(8, pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$"),
                     "headlines": obj({"basic": s(100)}),
                     "credits": obj({"by": arr(obj({"type": {"const": "author"}, "name": s(40)}), 1, 2)}),
                     "content_elements": arr({"anyOf": [_ANS_TEXT, _ANS_IMAGE]}, 1, 3),
                     "taxonomy": obj({"tags": arr(obj({"text": s(30)}), 0, 3)}, ())},
                    ("type", "version", "headlines", "content_elements"))),
    BenchSchema("wapo-image", "washington-post", "Write the record of a news photo.",
                obj({"type": {"const": "image"}, "url": s(100, pattern=r"^https://"),
                     "display_date": {"type": "string", "format": "date"},
                     "width": i(1, 10000), "height": i(1, 10000),
                     "caption": s(120), "credits": obj({"affiliation": arr(obj({"name": s(40)}), 0, 2)}, ())},
                    ("type", "url"))),
    # -- GlaiveAI function-call arguments ----------------------------------------------------------
    BenchSchema("glaive-stock-price", "glaive", "Arguments to get the stock price of Apple.",
                obj({"symbol": s(5, pattern=r"^[A-Z]{1,5}$")})),
    BenchSchema("glaive-loan-payment", "glaive", "Arguments to compute the monthly payment of a 200000 loan at 4% over 30 years.",
                obj({"principal": n(0, 10**8), "interest_rate": n(0, 30), "term_years": i(1, 40)})),
    BenchSchema("glaive-search-movies", "glaive", "Arguments to search for science fiction movies from 1999.",
                obj({"query": s(40), "genre": e("action", "comedy", "drama", "sci-fi", "horror"), "year": i(1900, 2030)},
                    ("query",))),
    BenchSchema("glaive-send-email", "glaive", "Arguments to email Bob that the meeting moved to 3pm.",
                {"type": "object", "properties": {"recipient": {"type": "string"}, "subject": {"type": "string"},
                                                  "message": {"type": "string"}},
                 "required": ["recipient", "subject", "message"]}),
    # -- JSONSchemaStore -----------------------------------------------------------------------------
    BenchSchema("store-prettierrc", "schemastore", "Write a .prettierrc for a TypeScript project.",
                obj({"printWidth": i(40, 200), "tabWidth": i(1, 8), "useTabs": b(), "semi": b(), "singleQuote": b(),
                     "trailingComma": e("all", "es5", "none"), "endOfLine": e("lf", "crlf", "cr", "auto")}, ())),
    BenchSchema("store-dependabot", "schemastore", "Write a dependabot.yml updating pip and npm weekly.",
                obj({"version": {"const": 2}, "updates": arr(obj({
                    "package-ecosystem": e("pip", "npm", "docker", "github-actions", "cargo"), "directory": s(20, pattern=r"^/"),
                    "schedule": obj({"interval": e("daily", "weekly", "monthly")}),
                    "open-pull-requests-limit": i(0, 50)}, ("package-ecosystem", "directory", "schedule")), 1, 3)})),
    BenchSchema("store-markdownlint", "schemastore", "Write a markdownlint config allowing long lines in code.",
                obj({"default": b(), "MD013": {"anyOf": [b(), obj({"line_length": i(40, 400), "code_blocks": b()}, ())]},
                     "MD033": {"anyOf": [b(), obj({"allowed_elements": arr(s(10), 0, 3)})]}}, ())),
    BenchSchema("store-pyproject", "schemastore", "Write the [project] table of a small Python package.",
                obj({"name": s(30, pattern=r"^[a-z][a-z0-9_-]*$"), "version": s(12, pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$"),
                     "requires-python": s(10, pattern=r"^>=3\.[0-9]+$"),
                     "dependencies": arr(s(30, pattern=r"^[a-z][a-z0-9_-]*(>=[0-9.]+)?$"), 0, 3),
                     "license": obj({"text": s(20)})}, ("name", "version"))),
    BenchSchema("store-cloudformation-bucket", "schemastore", "Write a CloudFormation resource for a versioned S3 bucket.",
                obj({"Type": {"const": "AWS::S3::Bucket"}, "Properties": obj({
                    "BucketName": s(63, pattern=r"^[a-z0-9][a-z0-9.-]{2,62}$"),
                    "VersioningConfiguration": obj({"Status": e("Enabled", "Suspended")}),
                    "Tags": arr(obj({"Key": s(20), "Value": s(30)}), 0, 2)}, ("BucketName",))})),
    BenchSchema("store-geojson-point", "schemastore", "Write a GeoJSON feature marking a cafe in Rome.",
                obj({"type": {"const": "Feature"},
                     "geometry": obj({"type": {"const": "Point"}, "coordinates": arr(n(-180, 180), 2, 2)}),
                     "properties": string_map({"type": ["string", "number", "boolean"]})})),
]
