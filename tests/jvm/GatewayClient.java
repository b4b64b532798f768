// Drives an OpenAI-compatible base URL with the JDK's own HTTP clients, as a Spring Boot
// service would, and prints one JSON line per (target, request) to stdout.
//
//   java GatewayClient MODE[,MODE...] LABEL=BASE_URL [LABEL=BASE_URL ...]
//
// Every request carries "X-Test-Target: LABEL" so the upstream can tell the legs apart.
// Modes:
//   client-chat      java.net.http.HttpClient with its defaults (HTTP/2 offered via h2c
//                    upgrade), POST /v1/chat/completions with a JSON body; one client per
//                    target, shared by the client-* modes of a run (as an app shares one)
//   client-stream    the same with "stream": true, the SSE body read with ofLines()
//   client-models    the same client, GET /v1/models
//   client-reqid     client-chat with a client-supplied X-Request-ID
//   client-chunked   client-chat with a body of unknown length (ofInputStream), so sent
//                    chunked alongside the h2c offer, as Spring's JdkClientHttpRequestFactory
//                    does for a streamed body
//   urlconn-chat     java.net.HttpURLConnection, chunked request body
//   urlconn-stream   the same with "stream": true, the SSE body read line by line
//   urlconn-reqid    urlconn-chat with a client-supplied X-Request-ID
//
// No external libraries: the JSON is written by hand.

import java.io.BufferedReader;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.URL;
import java.net.http.HttpClient;
import java.net.http.HttpHeaders;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;

public final class GatewayClient {
    static final String[] HEADERS_OF_INTEREST = {
        "content-type", "x-request-id", "x-gateway-backend", "transfer-encoding",
        "content-length", "upgrade", "connection",
    };
    static final Duration TIMEOUT = Duration.ofSeconds(30);
    static final int CHUNK_BYTES = 1024;
    static final Map<String, HttpClient> CLIENTS = new LinkedHashMap<>();

    public static void main(String[] args) throws Exception {
        if (args.length < 2) {
            System.err.println("usage: GatewayClient MODE[,MODE...] LABEL=BASE_URL ...");
            System.exit(2);
        }
        String[] modes = args[0].split(",");
        for (int i = 1; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            String label = args[i].substring(0, eq);
            String base = args[i].substring(eq + 1).replaceAll("/+$", "");
            for (String mode : modes) {
                Map<String, Object> out = new LinkedHashMap<>();
                out.put("mode", mode);
                out.put("target", label);
                try {
                    run(mode, label, base, out);
                } catch (Exception e) {
                    out.put("error", e.toString());
                }
                System.out.println(json(out));
                System.out.flush();
            }
        }
    }

    static void run(String mode, String label, String base, Map<String, Object> out)
            throws Exception {
        String reqId = "jvm-" + mode + "-" + label;
        switch (mode) {
            case "client-chat" -> client(out, label, base, chatBody(false), null);
            case "client-stream" -> client(out, label, base, chatBody(true), null);
            case "client-models" -> client(out, label, base, null, null);
            case "client-reqid" -> client(out, label, base, chatBody(false), reqId);
            case "client-chunked" -> client(out, label, base, chatBody(false), null, true);
            case "urlconn-chat" -> urlconn(out, label, base, chatBody(false), null);
            case "urlconn-stream" -> urlconn(out, label, base, chatBody(true), null);
            case "urlconn-reqid" -> urlconn(out, label, base, chatBody(false), reqId);
            default -> throw new IllegalArgumentException("unknown mode " + mode);
        }
    }

    /** A chat request of about 10 KB, so a chunked body spans several chunks. */
    static byte[] chatBody(boolean stream) {
        String filler = "0123456789".repeat(1000);
        String body = "{\"model\":\"test-model\",\"stream\":" + stream
                + ",\"messages\":[{\"role\":\"user\",\"content\":\"" + filler + "\"}]}";
        return body.getBytes(StandardCharsets.UTF_8);
    }

    /** java.net.http.HttpClient exactly as built by default (version HTTP_2). */
    static void client(Map<String, Object> out, String label, String base, byte[] body,
            String reqId) throws Exception {
        client(out, label, base, body, reqId, false);
    }

    static void client(Map<String, Object> out, String label, String base, byte[] body,
            String reqId, boolean unknownLength) throws Exception {
        HttpClient http = CLIENTS.computeIfAbsent(
                label, l -> HttpClient.newBuilder().connectTimeout(TIMEOUT).build());
        HttpRequest.Builder rb = HttpRequest.newBuilder()
                .timeout(TIMEOUT)
                .header("X-Test-Target", label)
                .header("Authorization", "Bearer sk-test");
        if (reqId != null) {
            rb.header("X-Request-ID", reqId);
        }
        boolean stream = false;
        if (body == null) {
            rb.uri(URI.create(base + "/v1/models")).GET();
        } else {
            stream = new String(body, StandardCharsets.UTF_8).contains("\"stream\":true");
            rb.uri(URI.create(base + "/v1/chat/completions"))
                    .header("Content-Type", "application/json")
                    .POST(unknownLength
                            ? HttpRequest.BodyPublishers.ofInputStream(
                                    () -> new java.io.ByteArrayInputStream(body))
                            : HttpRequest.BodyPublishers.ofByteArray(body));
            sent(out, body);
        }
        HttpRequest request = rb.build();
        if (stream) {
            HttpResponse<java.util.stream.Stream<String>> resp =
                    http.send(request, HttpResponse.BodyHandlers.ofLines());
            out.put("status", resp.statusCode());
            out.put("version", resp.version().toString());
            out.put("headers", headers(resp.headers()));
            try (var lines = resp.body()) {
                out.put("events", lines.filter(l -> !l.isEmpty()).collect(Collectors.toList()));
            }
        } else {
            HttpResponse<String> resp = http.send(request, HttpResponse.BodyHandlers.ofString());
            out.put("status", resp.statusCode());
            out.put("version", resp.version().toString());
            out.put("headers", headers(resp.headers()));
            out.put("body", resp.body());
        }
    }

    /** java.net.HttpURLConnection with a chunked request body. */
    static void urlconn(Map<String, Object> out, String label, String base, byte[] body,
            String reqId) throws Exception {
        boolean stream = new String(body, StandardCharsets.UTF_8).contains("\"stream\":true");
        URL url = URI.create(base + "/v1/chat/completions").toURL();
        HttpURLConnection conn = (HttpURLConnection) url.openConnection();
        conn.setConnectTimeout((int) TIMEOUT.toMillis());
        conn.setReadTimeout((int) TIMEOUT.toMillis());
        conn.setRequestMethod("POST");
        conn.setDoOutput(true);
        conn.setChunkedStreamingMode(CHUNK_BYTES);
        conn.setRequestProperty("Content-Type", "application/json");
        conn.setRequestProperty("Authorization", "Bearer sk-test");
        conn.setRequestProperty("X-Test-Target", label);
        if (reqId != null) {
            conn.setRequestProperty("X-Request-ID", reqId);
        }
        try (OutputStream os = conn.getOutputStream()) {
            // Several writes, as a serializer streaming into the connection would do.
            for (int off = 0; off < body.length; off += 700) {
                os.write(body, off, Math.min(700, body.length - off));
                os.flush();
            }
        }
        sent(out, body);
        int status = conn.getResponseCode();
        out.put("status", status);
        Map<String, Object> hs = new LinkedHashMap<>();
        for (String name : HEADERS_OF_INTEREST) {
            String v = conn.getHeaderField(name);
            if (v != null) {
                hs.put(name, v);
            }
        }
        out.put("headers", hs);
        InputStream in = status >= 400 ? conn.getErrorStream() : conn.getInputStream();
        try (BufferedReader r = new BufferedReader(
                new InputStreamReader(in, StandardCharsets.UTF_8))) {
            if (stream) {
                List<String> events = new ArrayList<>();
                String line;
                while ((line = r.readLine()) != null) {
                    if (!line.isEmpty()) {
                        events.add(line);
                    }
                }
                out.put("events", events);
            } else {
                out.put("body", r.lines().collect(Collectors.joining("\n")));
            }
        }
        conn.disconnect();
    }

    static void sent(Map<String, Object> out, byte[] body) throws Exception {
        out.put("sent_bytes", body.length);
        out.put("sent_sha256",
                HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(body)));
    }

    static Map<String, Object> headers(HttpHeaders headers) {
        Map<String, Object> hs = new LinkedHashMap<>();
        for (String name : HEADERS_OF_INTEREST) {
            headers.firstValue(name).ifPresent(v -> hs.put(name, v));
        }
        return hs;
    }

    // -- a minimal JSON writer ---------------------------------------------------------
    static String json(Object v) {
        StringBuilder sb = new StringBuilder();
        write(sb, v);
        return sb.toString();
    }

    static void write(StringBuilder sb, Object v) {
        if (v == null) {
            sb.append("null");
        } else if (v instanceof Number || v instanceof Boolean) {
            sb.append(v);
        } else if (v instanceof Map<?, ?> m) {
            sb.append('{');
            boolean first = true;
            for (Map.Entry<?, ?> e : m.entrySet()) {
                if (!first) {
                    sb.append(',');
                }
                first = false;
                write(sb, String.valueOf(e.getKey()));
                sb.append(':');
                write(sb, e.getValue());
            }
            sb.append('}');
        } else if (v instanceof List<?> l) {
            sb.append('[');
            for (int i = 0; i < l.size(); i++) {
                if (i > 0) {
                    sb.append(',');
                }
                write(sb, l.get(i));
            }
            sb.append(']');
        } else {
            String s = v.toString();
            sb.append('"');
            for (int i = 0; i < s.length(); i++) {
                char c = s.charAt(i);
                switch (c) {
                    case '"' -> sb.append("\\\"");
                    case '\\' -> sb.append("\\\\");
                    case '\n' -> sb.append("\\n");
                    case '\r' -> sb.append("\\r");
                    case '\t' -> sb.append("\\t");
                    default -> {
                        if (c < 0x20) {
                            sb.append(String.format("\\u%04x", (int) c));
                        } else {
                            sb.append(c);
                        }
                    }
                }
            }
            sb.append('"');
        }
    }
}
